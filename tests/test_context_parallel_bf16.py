"""bf16 inputs through the fused kernels: blocks merged in fp32, so the op at cp=2 stays as close to fp32 SDPA on the
whole sequence as bf16 SDPA itself is (causal, grouped-query, documents crossing chunks and ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tp_train.parallel.context_parallel import attention_mask, context_parallel_attention, shard_sequence

LENGTH = 64
DOCUMENTS = [9, 20, 3, 32]


def _attention(q, k, v, grad, op):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = op(q, k, v)
    out.backward(grad)
    return [t.detach().float() for t in (out, q.grad, k.grad, v.grad)]


def _rank_errors(rank, world_size, device="cpu"):
    generator = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(2, 8, LENGTH, 16, generator=generator).to(device) for _ in range(2))
    k, v = (torch.randn(2, 2, LENGTH, 16, generator=generator).to(device) for _ in range(2))
    ids = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS)).expand(2, -1).to(device)
    positions = torch.arange(LENGTH, device=device)
    mask = attention_mask(positions, positions, ids, ids)[:, None]

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    exact = _attention(q, k, v, grad, sdpa)
    bf16 = [t.bfloat16() for t in (q, k, v, grad)]
    plain = _attention(*bf16, sdpa)
    share = lambda t: shard_sequence(t, world_size, rank, dim=2)  # noqa: E731
    local_ids = shard_sequence(ids, world_size, rank, dim=1)
    ours = _attention(
        *(share(t) for t in bf16),
        lambda q, k, v: context_parallel_attention(q, k, v, dist.group.WORLD, document_ids=local_ids),
    )
    return [
        (float((o - share(e)).abs().max()), float((p - e).abs().max()))
        for o, p, e in zip(ours, plain, exact, strict=True)
    ]


def check_bf16(device="cpu"):
    for rank, errors in enumerate(run_on_ranks(_rank_errors, 2, device)):
        for name, (ours, plain) in zip(("out", "dq", "dk", "dv"), errors, strict=True):
            assert ours <= 2 * plain + 1e-3, f"rank {rank} {name}: {ours:.2e} from fp32 (bf16 SDPA: {plain:.2e})"


def test_bf16_at_cp2_is_as_close_to_fp32_as_bf16_sdpa():
    check_bf16()
