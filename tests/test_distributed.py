"""The spawn harness itself, pooled and fresh: results come back by rank, failures and hangs fail fast and name the
test, and a pooled task starts from a fresh rank's state whatever the task before it did."""

import functools
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_train.plan.applying.sequence_parallel as sequence_parallel
from tests.distributed import init_gloo, run_on_ranks


@pytest.fixture(params=["pooled", pytest.param("fresh", marks=pytest.mark.slow)])
def ranks(request, monkeypatch):
    """The test runs on pooled ranks and on fresh ones (those in the slow set: `make test-fast` checks the pool)."""
    if request.param == "fresh":
        monkeypatch.setenv("TP_TRAIN_TEST_FRESH_RANKS", "1")
    return request.param


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


def test_results_come_back_by_rank(ranks):
    out = run_on_ranks(_sum_of_ranks, 2)
    assert out == [(1.0, 1), (1.0, 1)]


def test_rank_exception_carries_traceback(ranks):
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_on_ranks(_raise_on_rank_one, 2)


def _hang(rank, world_size):
    time.sleep(600)


def test_hung_ranks_time_out_naming_them(ranks):
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1\] did not finish within 3s") as raised:
        run_on_ranks(_hang, 2, timeout=3)
    if ranks == "pooled":
        assert "test_distributed.py::test_hung_ranks_time_out_naming_them[pooled]" in str(raised.value)


def test_collective_a_rank_never_joins_fails_instead_of_hanging(ranks):
    # Rank 1 leaves without joining; rank 0's all-reduce fails (gloo sees the peer gone, or its timeout) -- either
    # way the test ends with rank 0's error rather than hanging.
    with pytest.raises(RuntimeError, match="rank 0 of 2 failed"):
        run_on_ranks(_rank_one_skips_collective, 2, timeout=20)


def _rank_one_exits(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def test_a_rank_that_dies_fails_the_task_at_once_with_its_exit_status(ranks):
    # Before its timeout: a pool that took the dead worker's closed pipe for one with news waited out the timeout,
    # polling it at full speed, and said the ranks did not finish.
    with pytest.raises(RuntimeError, match=r"ranks \[1\] exited with codes \[3\]"):
        run_on_ranks(_rank_one_exits, 2, timeout=60)


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


def _deadlock(rank, world_size):
    """Rank 0 waits in an all-reduce while rank 1 waits to receive from it: neither collective can complete."""
    if rank == 0:
        dist.all_reduce(torch.ones(1))
    else:
        dist.recv(torch.empty(1), src=0)


def _pid_and_sum(rank, world_size):
    return os.getpid(), _sum_of_ranks(rank, world_size)[0]


def test_a_task_that_deadlocks_its_ranks_fails_in_its_timeout_naming_itself_and_the_next_task_runs(ranks):
    started = time.monotonic()
    with pytest.raises((TimeoutError, RuntimeError), match="deadlocks_its_ranks") as raised:
        run_on_ranks(_deadlock, 2, timeout=5)
    assert time.monotonic() - started < 5 + 15, raised.value  # the timeout, then the grace a failed rank's peers get
    assert [total for _, total in run_on_ranks(_pid_and_sum, 2)] == [1.0, 1.0]


def test_pooled_ranks_are_reused(ranks):
    first, second = run_on_ranks(_pid_and_sum, 2), run_on_ranks(_pid_and_sum, 2)
    assert (first == second) == (ranks == "pooled"), (first, second)


def _dirty_the_state(rank, world_size, mode: str):
    """Changes what a later test must not see; `mode` picks one that cannot be set back."""
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.rand(3)
    os.environ["TP_TRAIN_LEFT_BY_A_TEST"] = "1"
    os.chdir("/")
    # A collective on the new group before returning: a rank that left the task (destroying its groups) while its peer
    # was still connecting the group's full mesh failed that peer with "Connection closed by peer" (CI, 2026-12-07).
    dist.barrier(group=dist.new_group([0, 1]))
    sequence_parallel._reduce_replicated_gradients = None  # as a negative control switches a step off
    if mode == "dispatch mode":
        from torch.utils._python_dispatch import TorchDispatchMode

        TorchDispatchMode().__enter__()
    elif mode == "thread":
        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()
    return os.getpid()


def _state(rank, world_size):
    groups = len(dist.distributed_c10d._world.pg_map)  # the default group only, in a fresh rank
    left = "TP_TRAIN_LEFT_BY_A_TEST" in os.environ
    modes = torch._C._len_torch_dispatch_stack()
    drawn = torch.rand(3).tolist()
    patched = sequence_parallel._reduce_replicated_gradients is None
    return (
        os.getpid(),
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        drawn,
        left,
        os.getcwd(),
        groups,
        modes,
        patched,
    )


@pytest.mark.parametrize("mode", ["restorable", "dispatch mode", "thread"])
def test_a_task_starts_from_a_fresh_ranks_state_whatever_the_task_before_it_did(ranks, mode):
    fresh = run_on_ranks(_state, 2)
    dirtied = run_on_ranks(_dirty_the_state, 2, mode)
    after = run_on_ranks(_state, 2)
    assert [state[1:] for state in after] == [state[1:] for state in fresh]
    assert fresh[0][1:4] == (torch.float32, True, fresh[1][3])  # every rank draws what every other draws
    reused = [state[0] for state in after] == dirtied
    assert reused == (ranks == "pooled" and mode == "restorable"), (mode, dirtied, after)


def test_every_test_kept_on_fresh_ranks_exists():
    """A renamed test or file would silently move to pooled ranks: each FRESH_RANKS entry names one that exists."""
    from tests.distributed import FRESH_RANKS

    for entry in FRESH_RANKS:
        file, _, name = entry.partition("::")
        source = (Path(__file__).parent / file).read_text()
        assert not name or f"def {name}(" in source, entry
