"""The spawn harness itself: results come back by rank, failures and hangs fail fast."""

import functools
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed import init_gloo, run_on_ranks


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


def _hang(rank, world_size):
    time.sleep(600)


def test_hung_ranks_time_out_naming_them():
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3s"):
        run_on_ranks(_hang, 2, timeout=3)


def test_collective_a_rank_never_joins_fails_instead_of_hanging():
    # Rank 1 leaves without joining; rank 0's all-reduce fails (gloo sees the peer gone, or its timeout) -- either
    # way the test ends with rank 0's error rather than hanging.
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed"):
        run_on_ranks(_rank_one_skips_collective, 2, timeout=20)


def _connection_closed_once(marker: str, rank, world_size, port, timeout):
    """gloo's rendezvous as on a loaded machine: the first time, rank 1's connection is closed by its peer."""
    if rank == 1 and not Path(marker).exists():
        Path(marker).write_text(str(port))
        raise RuntimeError(f"[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:{port}")
    init_gloo(rank, world_size, port, timeout)


def _failing_rendezvous(rank, world_size, port, timeout):
    raise RuntimeError("Connection reset by peer, every time")


def test_a_dropped_rendezvous_connection_starts_the_ranks_again(tmp_path):
    marker = tmp_path / "dropped"
    init = functools.partial(_connection_closed_once, str(marker))
    assert run_on_ranks(_sum_of_ranks, 2, init=init, timeout=60) == [(1.0, 1), (1.0, 1)]
    assert marker.exists()  # the fault did happen, on the first attempt
    with pytest.raises(RuntimeError, match="Connection reset by peer, every time"):  # retries are bounded
        run_on_ranks(_sum_of_ranks, 2, init=_failing_rendezvous, timeout=60)
