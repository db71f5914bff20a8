"""Exact attention over a context-parallel group whose ranks each hold a load-balanced share of the sequence."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_gather_single, reduce_scatter_single
from tp_train.parallel.context_parallel.document_mask import attention_mask
from tp_train.parallel.context_parallel.load_balance import local_positions

ROTATIONS = ("ring", "allgather")


def context_parallel_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup | None = None,
    *,
    causal: bool = True,
    document_ids: torch.Tensor | None = None,
    scale: float | None = None,
    rotation: str = "ring",
) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v over the whole sequence, for this rank's share of the queries.

    Args:
        q: (B, Hq, Tl, D) this rank's share of the queries (`shard_sequence` order), Tl = T / cp.
        k, v: (B, Hkv, Tl, D) its share of the keys and values; Hkv divides Hq (grouped-query attention).
        group: the context-parallel group (None: the default group, or one process without torch.distributed).
        causal: keys after the query (by global position) are masked.
        document_ids: (B, Tl) this rank's share of the document ids, or None: a query attends only to keys of
            its own document (block-diagonal), which holds across ranks.
        scale: the score scale, 1/sqrt(D) by default.
        rotation: "ring" or "allgather" (see the module docstring).

    Returns:
        (B, Hq, Tl, D) the attention output for this rank's queries, in q's dtype. Backward returns gradients
        for this rank's q, k and v (each K/V's gradient is summed over every rank that attended to it).
    """
    if rotation not in ROTATIONS:
        raise ValueError(f"rotation={rotation!r} is not one of {ROTATIONS}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    documents = None if document_ids is None else _gather(document_ids.contiguous(), group, dim=1)
    return _ContextParallelAttention.apply(q, k, v, group, causal, documents, scale, rotation)


class _ContextParallelAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, documents, scale, rotation):
        plan = _Pairs(q, group, causal, documents)
        queries = _grouped(q, k.shape[1])  # (B, Hkv, g, Tl, D)
        acc = torch.zeros(queries.shape, dtype=torch.float32, device=q.device)
        row_max = torch.full(queries.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        row_sum = torch.zeros(queries.shape[:-1], dtype=torch.float32, device=q.device)
        for source, (keys, values) in _visits(k, v, group, rotation):
            for rows, cols, mask in plan.pairs(source):
                scores = _scores(queries[..., rows, :], keys[..., cols, :], mask, scale)
                new_max = torch.maximum(row_max[..., rows], scores.amax(dim=-1))
                safe = torch.where(new_max.isinf(), torch.zeros_like(new_max), new_max)  # a row with no key yet
                probs = torch.exp(scores - safe.unsqueeze(-1))
                decay = torch.exp(row_max[..., rows] - safe)
                row_sum[..., rows] = row_sum[..., rows] * decay + probs.sum(dim=-1)
                block = values[..., cols, :].float().unsqueeze(2)
                acc[..., rows, :] = acc[..., rows, :] * decay.unsqueeze(-1) + probs @ block
                row_max[..., rows] = new_max
        out = acc / row_sum.unsqueeze(-1)  # every query sees at least its own key, so row_sum > 0
        lse = row_max + row_sum.log()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.scale, ctx.rotation, ctx.group = plan, scale, rotation, group
        return out.flatten(1, 2).to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        plan, scale = ctx.plan, ctx.scale
        queries = _grouped(q, k.shape[1])
        grad = _grouped(grad_out, k.shape[1]).float()
        delta = (grad * out).sum(dim=-1)  # (B, Hkv, g, Tl): rowsum(dO * O), the softmax backward's correction
        grad_q = torch.zeros(queries.shape, dtype=torch.float32, device=q.device)

        def block_grads(source, keys, values, grad_k, grad_v):
            for rows, cols, mask in plan.pairs(source):
                scores = _scores(queries[..., rows, :], keys[..., cols, :], mask, scale)
                probs = torch.exp(scores - lse[..., rows].unsqueeze(-1))  # masked scores are -inf: 0
                grad_v[..., cols, :] += (probs.transpose(-1, -2) @ grad[..., rows, :]).sum(dim=2)
                grad_probs = grad[..., rows, :] @ values[..., cols, :].float().unsqueeze(2).transpose(-1, -2)
                grad_scores = probs * (grad_probs - delta[..., rows].unsqueeze(-1)) * scale
                grad_q[..., rows, :] += grad_scores @ keys[..., cols, :].float().unsqueeze(2)
                grad_k[..., cols, :] += (grad_scores.transpose(-1, -2) @ queries[..., rows, :].float()).sum(dim=2)

        if ctx.rotation == "allgather":
            grad_k, grad_v = _ring_free_grads(k, v, ctx.group, block_grads)
        else:
            grad_k, grad_v = _ring_grads(k, v, ctx.group, block_grads)
        return grad_q.flatten(1, 2).to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None


class _Pairs:
    """The (query chunk, key chunk) pairs of this rank's queries against one source rank's keys, with their masks;
    pairs masked entirely are left out."""

    def __init__(self, q, group, causal, documents):
        self.size, self.rank = _size(group), _rank(group)
        self.length = q.shape[2] // 2  # one chunk
        total = q.shape[2] * self.size
        self.causal, self.documents = causal, documents  # documents: (B, cp, Tl) every rank's share
        self.positions = [local_positions(total, self.size, r, device=q.device) for r in range(self.size)]

    def pairs(self, source: int):
        n = self.length
        for i in range(2):
            rows = slice(i * n, (i + 1) * n)
            for j in range(2):
                cols = slice(j * n, (j + 1) * n)
                q_docs = k_docs = None
                if self.documents is not None:
                    q_docs, k_docs = self.documents[:, self.rank, rows], self.documents[:, source, cols]
                mask = attention_mask(
                    self.positions[self.rank][rows], self.positions[source][cols], q_docs, k_docs, self.causal
                )
                if mask is not None and not bool(mask.any()):
                    continue  # nothing of this pair is attended: skipped, not computed
                yield rows, cols, None if mask is None or bool(mask.all()) else mask


def _scores(queries, keys, mask, scale):
    """(B, Hkv, g, Tq, Tk) fp32 scores of grouped queries against one chunk of keys, masked ones -inf."""
    scores = (queries @ keys.unsqueeze(2).transpose(-1, -2)).float() * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
    return scores


def _grouped(x, kv_heads):
    """(B, Hq, T, D) -> (B, Hkv, Hq / Hkv, T, D): the query heads that share each key/value head."""
    batch, heads, length, dim = x.shape
    return x.reshape(batch, kv_heads, heads // kv_heads, length, dim)


def _visits(k, v, group, rotation):
    """Yields (source rank, (its keys, its values)) for every rank of the group, this rank's first."""
    size, rank = _size(group), _rank(group)
    if rotation == "allgather" and size > 1:
        keys, values = _gather(k.contiguous(), group, dim=0), _gather(v.contiguous(), group, dim=0)
        for offset in range(size):
            source = (rank - offset) % size
            yield source, (keys[source], values[source])
        return
    buffer = torch.stack([k, v])
    for step in range(size):
        pending = _shift(buffer, group) if step < size - 1 else None  # the next share travels while this computes
        yield (rank - step) % size, (buffer[0], buffer[1])
        if pending is not None:
            buffer = pending()


def _ring_grads(k, v, group, block_grads):
    """Backward of the ring: each K/V share travels the ring with its gradient, which every rank adds to; after a
    full turn the gradient is back at the share's owner."""
    size, rank = _size(group), _rank(group)
    buffer = torch.stack([k, v])
    grads = torch.zeros(buffer.shape, dtype=torch.float32, device=k.device)
    for step in range(size):
        pending = _shift(buffer, group) if step < size - 1 else None
        block_grads((rank - step) % size, buffer[0], buffer[1], grads[0], grads[1])
        if pending is not None:
            buffer = pending()  # K/V first, then their gradients: one message in flight per pair of ranks
        grads = _shift(grads, group)() if size > 1 else grads
    return grads[0], grads[1]


def _ring_free_grads(k, v, group, block_grads):
    """Backward of the all-gather: every rank's K/V gathered again, gradients reduce-scattered to their owners."""
    size = _size(group)
    if size == 1:
        grads = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
        block_grads(0, k, v, grads[0], grads[1])
        return grads[0], grads[1]
    keys, values = _gather(k.contiguous(), group, dim=0), _gather(v.contiguous(), group, dim=0)
    grads = torch.zeros((size, 2, *k.shape), dtype=torch.float32, device=k.device)
    for source in range(size):
        block_grads(source, keys[source], values[source], grads[source, 0], grads[source, 1])
    mine = torch.empty((2, *k.shape), dtype=torch.float32, device=k.device)
    reduce_scatter_single(mine, grads.flatten(0, 1), group=group)  # rank after rank along dim 0
    return mine[0], mine[1]


def _shift(tensor, group):
    """Starts sending `tensor` to the next rank of the group and receiving the previous rank's; returns a function
    that waits and returns what arrived. Gloo sends only host memory, so on gloo a CUDA tensor travels through the
    host (one GPU shared by the ranks of a test or a laptop; NCCL sends device memory)."""
    size, rank = _size(group), _rank(group)
    device = tensor.device
    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        tensor = tensor.cpu()
    received = torch.empty_like(tensor)
    to_rank = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    from_rank = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    ops = [
        dist.P2POp(dist.isend, tensor.contiguous(), to_rank, group),
        dist.P2POp(dist.irecv, received, from_rank, group),
    ]
    works = dist.batch_isend_irecv(ops)

    def wait():
        for work in works:
            work.wait()
        return received.to(device)

    return wait


def _gather(x, group, dim):
    """Every rank's `x` stacked along a new `dim` (by group rank); x itself when the group is one rank."""
    if _size(group) == 1:
        return x.unsqueeze(dim)
    out = torch.empty((_size(group) * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_gather_single(out, x, group=group)  # rank after rank along dim 0
    return out.view(_size(group), *x.shape).movedim(0, dim)


def _size(group):
    return 1 if group is None and not dist.is_initialized() else dist.get_world_size(group)


def _rank(group):
    return 0 if group is None and not dist.is_initialized() else dist.get_rank(group)
