"""Run a function on real gloo ranks spawned from pytest.

Every distributed test goes through `run_on_ranks`. Its ranks are processes forked from a fork server (a clean
process that imported torch, Lightning and tp_train once; never pytest itself, whose sys.argv Lightning's launcher
would re-execute), joined into a gloo process group, with one thread per rank so that several ranks share the 2 CPU
cores without thrashing. A rank's exception comes back to the parent with its traceback; a rank that hangs (say, in
a collective another rank never joined) fails the test after `timeout` seconds instead of hanging CI.

Most tests run on pooled ranks (`tests/rank_pool.py`): forked once per world size and pytest worker, each test a
task on a new process group, its state set back to the fork's after every task. The tests of FRESH_RANKS, and
those that pass their own `init`, get ranks forked for them alone, joined on a free localhost port, as before:
faults, hangs, signals and exits, peak-memory measurements (a warm process's peak is not a fresh one's), and
compiles (a warm dynamo cache can hide a recompile). `TP_TRAIN_TEST_FRESH_RANKS=1` runs every test on fresh ranks.
"""

from __future__ import annotations

import atexit
import gc
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests import timing
from tests.rank_pool import Pools, RendezvousFailed
from tests.timing import current_test


def free_port() -> int:
    """A TCP port on localhost that nothing is listening on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int, timeout: float) -> None:
    """Joins this process into the gloo group of `world_size` ranks that rank 0 hosts on `port`."""
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )


# What init_process_group raises when the rendezvous itself failed, before `fn` ran, so the ranks can start again on
# another port: the port was taken, or gloo's full mesh lost a connection while the ranks connected to each other
# (seen on a loaded machine: "Connection closed by peer" from connectFullMesh).
_RETRIED_RENDEZVOUS_ERRORS = ("EADDRINUSE", "Connection closed by peer", "Connection reset")


def _retried(error: str) -> bool:
    return any(sign in error for sign in _RETRIED_RENDEZVOUS_ERRORS)


def _rank_main(
    rank: int, world_size: int, port: int, fn: Callable, args: tuple, results, timeout: float, init: Callable
):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    gc.freeze()  # the fork server's imports: out of this rank's collections, which would walk (and copy) them
    torch.set_num_threads(1)
    timing.time_phases()
    try:
        try:
            init(rank, world_size, port, timeout)
        except Exception as error:  # noqa: BLE001 - only the rendezvous failures above are retried
            if not _retried(str(error)):
                raise
            results.put((rank, "rendezvous failed", traceback.format_exc()))  # before fn ran: the parent retries
            return
        # Plain pickle bytes: torch's queue would pass tensors by shared memory, gone once this process exits.
        started = time.monotonic()
        result = pickle.dumps(fn(rank, world_size, *args))
        results.put((rank, "ok", (result, (started, time.monotonic(), timing.phases_spent()))))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Imported once by the fork server, so each rank starts in well under a second instead of importing them again.
PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "transformers", "tp_train", "models"]


def _context():
    """A fork server: a clean process (not pytest) that imports the heavy modules once and forks every rank."""
    # A fixed mmap threshold (glibc raises it after large frees and then keeps freed tensors' pages in its heap),
    # so a rank's resident memory tracks its live tensors; the fork server passes it on to every rank.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


# Tests whose ranks are forked for them alone, by file or by `file::test` (every parameter alike).
FRESH_RANKS = {
    "test_rank_failure.py",  # a rank hung until the strategy's limit, ranks killed
    "test_preemption.py",  # signals sent to ranks
    "test_async_writer.py",  # a process that exits right after a save
    "test_context_parallel_memory.py",  # peak resident memory, measured
    "test_deferred_init.py::test_meta_init_peak_memory_per_rank_is_below_the_model_size",
    "test_compile.py",  # dynamo's caches and counters
    "test_compiled_loss.py",
}


def fresh_ranks_wanted(init: Callable = init_gloo) -> bool:
    """Whether the running test gets ranks of its own (FRESH_RANKS, its own `init`, or TP_TRAIN_TEST_FRESH_RANKS)."""
    if init is not init_gloo or os.environ.get("TP_TRAIN_TEST_FRESH_RANKS") == "1":
        return True
    path, _, name = current_test().partition("::")  # "tests/test_x.py::test_y[param]"
    file = os.path.basename(path)
    return file in FRESH_RANKS or f"{file}::{name.split('[')[0]}" in FRESH_RANKS


_POOLS: list[Pools] = []  # this process's pools, made at the first pooled call


def _pools() -> Pools:
    if not _POOLS:
        _POOLS.append(Pools(_context(), init_gloo))
        atexit.register(_POOLS[0].close)
    return _POOLS[0]


def run_on_ranks(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, init: Callable = init_gloo
) -> list[Any]:
    """Runs `fn(rank, world_size, *args)` on `world_size` gloo ranks and returns each rank's result, by rank.

    `fn` must be importable (a module-level function) and its result picklable. `init(rank, world_size, port,
    timeout)` joins each rank into the group (a test may wrap `init_gloo` to inject a fault; such a test gets fresh
    ranks). Raises `RuntimeError` with the failing rank's traceback, or `TimeoutError` naming the ranks that never
    reported.
    """
    called = time.monotonic()
    fresh = fresh_ranks_wanted(init)
    for attempt in range(_RENDEZVOUS_ATTEMPTS):
        try:
            if fresh:
                outputs, spans = _run_once(_context(), free_port(), fn, world_size, args, timeout, init)
            else:
                outputs, spans = _pools().run(fn, world_size, args, timeout, free_port())
            break
        except RendezvousFailed as error:
            if attempt == _RENDEZVOUS_ATTEMPTS - 1 or not _retried(str(error)):
                raise
    started, ended = max(span[0] for span in spans), max(span[1] for span in spans)
    phases = {f"{phase}_s": max(span[2].get(phase, 0.0) for span in spans) for phase in timing.PHASES}
    function = max(end - start for start, end, _ in spans)
    kind = f"ranks {'fresh' if fresh else 'pooled'} x{world_size}"
    timing.record(kind, start_s=started - called, fn_s=function, end_s=time.monotonic() - ended, **phases)
    return outputs


# free_port's port can be taken before rank 0 listens on it (by another pytest worker, or by any connection that
# draws the same ephemeral port), or a connection of the rendezvous can drop; either way no rank ran `fn`, and the
# ranks start again elsewhere.
_RENDEZVOUS_ATTEMPTS = 3


def _run_once(ctx, port: int, fn: Callable, world_size: int, args: tuple, timeout: float, init) -> list[Any]:
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(rank, world_size, port, fn, args, results, timeout, init), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outputs: dict[int, Any] = {}
    spans: dict[int, tuple[float, float]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            try:
                rank, status, payload = results.get(timeout=1.0)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(outputs))
                dead = [r for r in missing if procs[r].exitcode not in (None, 0)]
                if dead:  # died without reporting (killed, or crashed before running fn)
                    codes = [procs[r].exitcode for r in dead]
                    raise RuntimeError(f"{current_test()}: ranks {dead} exited with codes {codes}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{current_test()}: ranks {missing} did not finish within {timeout:.0f}s"
                    ) from None
                continue
            if status == "rendezvous failed":
                raise RendezvousFailed(payload)
            if status == "error":
                raise RuntimeError(f"{current_test()}: rank {rank} of {world_size} failed:\n{payload}")
            outputs[rank], spans[rank] = pickle.loads(payload[0]), payload[1]
    finally:
        grace = 10 if len(outputs) == world_size else 1  # after a failure, the others need not finish
        for proc in procs:
            proc.join(timeout=grace)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [outputs[rank] for rank in range(world_size)], [spans[rank] for rank in range(world_size)]
