"""The spawn harness itself: results come back by rank, failures and hangs fail fast."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks


def _sum_of_ranks(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item(), torch.get_num_threads()


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


def _rank_one_skips_collective(rank, world_size):
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    return rank


def test_results_come_back_by_rank():
    out = run_on_ranks(_sum_of_ranks, 2)
    assert out == [(1.0, 1), (1.0, 1)]


def test_rank_exception_carries_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 2)


def test_hung_collective_fails_instead_of_hanging():
    with pytest.raises((TimeoutError, RuntimeError)):
        run_on_ranks(_rank_one_skips_collective, 2, timeout=10)
