"""The context-parallel attention op never holds a block of scores: on real gloo ranks, the measured peak resident
set of one forward + backward (reset before the step) stays under half of one fp32 score matrix of a single
(query chunk, key chunk) pair, B x Hq x (T / 2cp)^2 x 4 bytes, which a ring computing scores in PyTorch ops
(and a dense document mask's chunk pairs) exceeds several times over."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tp_train.parallel.context_parallel import context_parallel_attention, shard_sequence
from tp_train.tools.bench.measure import current_memory, peak_memory, reset_peak_memory, return_freed_memory_at_once

LENGTH, HEADS, KV_HEADS, HEAD_DIM = 8192, 2, 1, 64
DOCUMENTS = [700, 1500, 300, 2600, 1000, 2092]  # cross chunk boundaries (2048 and 4096 at cp=2) and rank shares


def _rank_peak(rank, world_size, masked):
    cpu = torch.device("cpu")
    return_freed_memory_at_once(cpu)
    _step(rank, world_size, masked)  # a warm-up: thread pools, gloo's buffers, the kernels' own
    return _step(rank, world_size, masked)


def _step(rank, world_size, masked):
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, HEADS, LENGTH, HEAD_DIM), *[(1, KV_HEADS, LENGTH, HEAD_DIM)] * 2, (1, HEADS, LENGTH, HEAD_DIM)]
    q, k, v, grad = (shard_sequence(torch.randn(s, generator=generator), world_size, rank, dim=2) for s in shapes)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    grad = grad.clone()
    ids = None
    if masked:
        ids = torch.repeat_interleave(torch.arange(len(DOCUMENTS)), torch.tensor(DOCUMENTS))[None]
        ids = shard_sequence(ids, world_size, rank, dim=1)
    group = dist.group.WORLD if world_size > 1 else None
    before = current_memory(cpu)
    reset_peak_memory(cpu)
    context_parallel_attention(q, k, v, group, document_ids=ids).backward(grad)
    return peak_memory(cpu) - before


@pytest.mark.parametrize(
    ("cp", "masked"),
    [pytest.param(1, True, marks=pytest.mark.slow), (2, False), pytest.param(2, True, marks=pytest.mark.slow)],
)
def test_peak_stays_under_half_a_chunk_pairs_scores(cp, masked):
    chunk = LENGTH // (2 * cp)
    scores = HEADS * chunk * chunk * 4  # one fp32 (B, Hq, T / 2cp, T / 2cp) score matrix
    for rank, peak in enumerate(run_on_ranks(_rank_peak, cp, masked, timeout=120)):
        assert peak < scores / 2, (
            f"cp={cp} masked={masked} rank {rank}: peak {peak / 2**20:.1f} MiB >= half of one chunk pair's "
            f"fp32 scores ({scores / 2**21:.1f} MiB): a (T / cp)^2 score block is held again"
        )
