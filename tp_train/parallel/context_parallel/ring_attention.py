"""Exact attention over a context-parallel group whose ranks each hold a load-balanced share of the sequence.

Keys and values reach each rank by one of two rotations: "ring" passes each rank's share to the next rank while the
current one is attended to (cp - 1 sends of one share); "allgather" gathers every share at once (memory for the
whole sequence's K/V, one collective). Either way each (query chunk, key chunk) pair runs on torch's fused attention
kernel (`fused_attention`), the blocks merged by their log-sum-exp in fp32; backward runs the fused backward of each
pair from the merged output and log-sum-exp, K/V gradients travelling back to their owners. Nothing of size
(T / cp)^2 is allocated; packed documents run one call per document of each pair (`block_pairs`).

A third exchange, "alltoall" (DeepSpeed-Ulysses, arXiv 2309.14509), moves the queries instead of passing keys:
one all-to-all trades each rank's share of the tokens for 1/cp of the heads over the whole sequence
(`head_exchange`), the same fused calls run on the whole sequence as on one process, and a second all-to-all brings
the output back to sequence shards. The query heads on each rank must divide by cp; kv heads are repeated until cp
divides them, so that each rank receives whole kv heads.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_gather_single, reduce_scatter_single
from tp_train.parallel.context_parallel.block_pairs import TILE, BlockPairs
from tp_train.parallel.context_parallel.fused_attention import block_backward, block_forward, merge_block
from tp_train.parallel.context_parallel.head_exchange import heads_to_sequence, sequence_to_heads
from tp_train.parallel.context_parallel.load_balance import unshard_sequence
from tp_train.parallel.widening import statistics_dtype

ROTATIONS = ("ring", "allgather", "alltoall")


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
        rotation: "ring", "allgather" or "alltoall" (see the module docstring); "alltoall" needs Hq divisible by cp.

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
    if rotation == "alltoall" and _size(group) > 1:
        return _all_to_all_attention(q, k, v, group or dist.group.WORLD, causal, documents, scale)
    return _ContextParallelAttention.apply(q, k, v, group, causal, documents, scale, rotation, False)


def check_heads(q_heads: int, cp: int, where: str = "attention") -> None:
    """Raises a one-line error naming `where` unless `q_heads` (this rank's query heads, after tensor parallelism)
    divide by `cp`, as the "alltoall" exchange needs (each rank attends with whole heads)."""
    if q_heads % cp:
        fitting = [size for size in range(2, q_heads + 1) if q_heads % size == 0]
        raise ValueError(
            f"{where}: {q_heads} query heads per rank (after tensor parallelism) do not divide by cp={cp}, as "
            f"context_parallel_rotation='alltoall' needs; use cp in {fitting or [1]} or rotation 'ring' or 'allgather'"
        )


def _all_to_all_attention(q, k, v, group, causal, documents, scale):
    """The "alltoall" exchange: kv heads repeated until cp divides them, q, k, v sent to head shards in one
    all-to-all, attention over the whole sequence on this rank's heads, the output sent back to sequence shards."""
    size, q_heads = group.size(), q.shape[1]
    check_heads(q_heads, size)
    repeats = size // math.gcd(k.shape[1], size)  # kv head i becomes heads i x repeats .. (i + 1) x repeats - 1
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    kv_heads = k.shape[1]
    exchanged = sequence_to_heads((q, k, v), group)  # one all-to-all for all three
    q, k, v = exchanged.split([q_heads // size, kv_heads // size, kv_heads // size], dim=1)
    if documents is not None:  # (B, cp, Tl) every rank's share -> (B, 1, T) the whole sequence's, in order
        documents = unshard_sequence(list(documents.unbind(1)), dim=1).unsqueeze(1)
    out = _ContextParallelAttention.apply(q, k, v, group, causal, documents, scale, "ring", True)
    return heads_to_sequence(out, group)


def workspace_bytes(
    batch: int, q_heads: int, kv_heads: int, head_dim: int, tokens: int, cp: int = 1, rotation: str = "ring",
    element_size: int = 4,
) -> int:  # fmt: skip
    """Bytes one `context_parallel_attention` allocates at its peak, in its backward, beyond its inputs and output
    (the activations a model saves): the fp32 gradient of the queries, the keys' and values' fp32 gradients (twice
    while they travel the ring; every share's with the all-gather), the shares received, and one tile's call of the
    fused backward (its dq, dk, dv and the kernel's own buffer the size of its dq).

    Args:
        batch, q_heads, kv_heads, head_dim: the attention's shape.
        tokens: the whole sequence's length T; each rank holds T / cp.
        cp, rotation: the context-parallel size and rotation.
        element_size: bytes per element of q, k, v (4 for fp32, 2 for bf16).
    """
    share = -(-tokens // cp)
    queries, keys = batch * q_heads * share * head_dim, batch * kv_heads * share * head_dim
    tile = min(TILE, share)
    tile_call = 2 * batch * (q_heads + kv_heads) * tile * head_dim * element_size
    if rotation == "alltoall" and cp > 1:  # Hq / cp heads over T tokens: as many elements as a share of every head
        keys = batch * (kv_heads * cp // math.gcd(kv_heads, cp)) * share * head_dim  # after repeating kv heads
        exchanged = (queries + 2 * keys) * element_size  # q, k, v on head shards, saved for backward
        # the exchanged q, k, v and output, fp32 gradients of q, k, v, and the gradients' exchange buffers
        return exchanged + queries * element_size + (queries + 2 * keys) * 4 + 2 * exchanged + tile_call
    if cp == 1:
        travelling = 2 * keys * 4  # the fp32 gradients of k and v
    elif rotation == "allgather":
        travelling = cp * 2 * keys * (element_size + 4) + 2 * keys * 4  # every share and its gradient, then mine
    else:
        travelling = 2 * keys * element_size + 2 * 2 * keys * 4  # the next share; the gradients sent and received
    return queries * 4 + travelling + tile_call


class _ContextParallelAttention(torch.autograd.Function):
    """Forward: one fused call per block pair, merged by log-sum-exp in fp32. Backward: the fused backward of each
    block pair given the merged output and log-sum-exp (`fused_attention.block_backward`)."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, documents, scale, rotation, whole):
        """`whole`: this rank holds the whole sequence (after "alltoall"): one process's attention, nothing sent."""
        size, rank = (1, 0) if whole else (_size(group), _rank(group))
        pairs = BlockPairs(q.shape[2], size, rank, causal, documents)
        out = torch.zeros(q.shape, dtype=statistics_dtype(q.dtype), device=q.device)  # (B, Hq, Tl, D)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=out.dtype, device=q.device)  # (B, Hq, Tl)
        for source, (keys, values) in _visits(k, v, group, rotation, size, rank):
            for call in pairs.calls(source):
                queries, where = q[call.batch, :, call.rows], (call.batch, slice(None), call.rows)
                block_out, block_lse = block_forward(
                    queries, keys[call.batch, :, call.columns], values[call.batch, :, call.columns], call.causal, scale
                )
                merge_block(out[where], lse[where], block_out, block_lse)
                del block_out, block_lse
        out = out.to(q.dtype)  # fp32 inputs: the same tensor
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.pairs, ctx.scale, ctx.rotation, ctx.group, ctx.size, ctx.rank = pairs, scale, rotation, group, size, rank
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        pairs, scale = ctx.pairs, ctx.scale
        grad_q = torch.zeros(q.shape, dtype=statistics_dtype(q.dtype), device=q.device)

        def block_grads(source, keys, values, grad_k, grad_v):
            for call in pairs.calls(source):
                where, columns = (call.batch, slice(None), call.rows), (call.batch, slice(None), call.columns)
                dq, dk, dv = block_backward(
                    grad_out[where], q[where], keys[columns], values[columns], out[where], lse[where], call.causal,
                    scale,
                )  # fmt: skip
                grad_q[where] += dq
                grad_k[columns] += dk
                grad_v[columns] += dv
                del dq, dk, dv

        if ctx.rotation == "allgather":
            grad_k, grad_v = _ring_free_grads(k, v, ctx.group, ctx.size, block_grads)
        else:
            grad_k, grad_v = _ring_grads(k, v, ctx.group, ctx.size, ctx.rank, block_grads)
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None, None, None, None, None


def _visits(k, v, group, rotation, size, rank):
    """Yields (source rank, (its keys, its values)) for every rank of the group, this rank's first."""
    if rotation == "allgather" and size > 1:
        keys, values = _gather(k.contiguous(), group, dim=0), _gather(v.contiguous(), group, dim=0)
        for offset in range(size):
            source = (rank - offset) % size
            yield source, (keys[source], values[source])
        return
    shares = [k, v]
    for step in range(size):
        pending = _shift(shares, group) if step < size - 1 else None  # the next share travels while this computes
        yield (rank - step) % size, shares
        if pending is not None:
            shares = pending()


def _ring_grads(k, v, group, size, rank, block_grads):
    """Backward of the ring: each K/V share travels the ring with its gradient, which every rank adds to; after a
    full turn the gradient is back at the share's owner."""
    shares = [k, v]
    grads = [torch.zeros(k.shape, dtype=statistics_dtype(k.dtype), device=k.device) for _ in range(2)]
    for step in range(size):
        pending = _shift(shares, group) if step < size - 1 else None
        block_grads((rank - step) % size, *shares, *grads)
        shares = pending() if pending is not None else None  # K/V first, then their gradients: one message at a time
        grads = _shift(grads, group)() if size > 1 else grads
    return grads


def _ring_free_grads(k, v, group, size, block_grads):
    """Backward of the all-gather: every rank's K/V gathered again, gradients reduce-scattered to their owners."""
    if size == 1:
        grads = torch.zeros((2, *k.shape), dtype=statistics_dtype(k.dtype), device=k.device)
        block_grads(0, k, v, grads[0], grads[1])
        return grads[0], grads[1]
    keys, values = _gather(k.contiguous(), group, dim=0), _gather(v.contiguous(), group, dim=0)
    grads = torch.zeros((size, 2, *k.shape), dtype=statistics_dtype(k.dtype), device=k.device)
    for source in range(size):
        block_grads(source, keys[source], values[source], grads[source, 0], grads[source, 1])
    mine = torch.empty((2, *k.shape), dtype=grads.dtype, device=k.device)
    reduce_scatter_single(mine, grads.flatten(0, 1), group=group)  # rank after rank along dim 0
    return mine[0], mine[1]


def _shift(tensors, group):
    """Starts sending each of `tensors` to the next rank of the group and receiving the previous rank's; returns a
    function that waits and returns what arrived. Gloo sends only host memory, so on gloo a CUDA tensor travels
    through the host (one GPU shared by the ranks of a test or a laptop; NCCL sends device memory)."""
    size, rank = _size(group), _rank(group)
    device = tensors[0].device
    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        tensors = [tensor.cpu() for tensor in tensors]
    tensors = [tensor.contiguous() for tensor in tensors]
    received = [torch.empty_like(tensor) for tensor in tensors]
    to_rank = dist.get_global_rank(group, (rank + 1) % size) if group is not None else (rank + 1) % size
    from_rank = dist.get_global_rank(group, (rank - 1) % size) if group is not None else (rank - 1) % size
    ops = [dist.P2POp(dist.isend, tensor, to_rank, group) for tensor in tensors]
    ops += [dist.P2POp(dist.irecv, tensor, from_rank, group) for tensor in received]
    works = dist.batch_isend_irecv(ops)

    def wait():
        for work in works:
            work.wait()
        return [tensor.to(device) for tensor in received]

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
