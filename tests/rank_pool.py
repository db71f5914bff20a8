"""Persistent gloo ranks for `run_on_ranks`: workers forked once per world size and pytest worker, each test a task.

A fresh rank costs a fork, a rendezvous, and the imports its function brings (the test module, pytest, a Hugging
Face family's modelling code) every time; a pool's workers pay the fork and the imports once. What a task sees is
what a fresh rank sees: before each task every worker joins a new default process group on a port of the task's own
(rank 0 hosts its store there, so a Lightning strategy in the task finds it as in a fresh rank), and after it every
group is destroyed and the worker's state is set back to the one it had when it was forked: random generators,
default dtype and device, grad mode, environment, working directory, signal handlers, warnings filters, thread
count, torch.nn's global hooks, DTensor's sharding caches, and the attributes of the project's own modules
(tp_train, models, tests) that a task rebound. What cannot be set back (a torch function or dispatch mode left
active, a thread left running, the group not destroyable) retires the pool: its workers are killed, and the next task
gets a new one.

A task that fails on one rank gives the others a short grace to finish (they see the failed rank leave the group);
one that does not finish within its timeout, or whose worker dies, kills the pool, and the error names the test.
"""

from __future__ import annotations

import gc
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist

from tests import timing
from tests.timing import current_test

# A pytest worker keeps at most this many idle rank processes across its pools (world sizes 1, 2 and 4 fit); a
# pool that would go past it evicts the least recently used ones (a pool of 8 ranks evicts every other one).
MAX_POOLED_RANKS = 7

# How long the other ranks of a task in which one rank failed may take to report before the pool is killed.
_GRACE_AFTER_FAILURE = 10.0

_SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2]

# The project's own packages: an attribute of one of their modules that a task rebinds (a test that patches a function
# to count its calls, or to switch a step off for a negative control) is bound back after the task.
_OWN_PACKAGES = ("tp_train", "models", "tests", "train")
_MISSING = object()


def _own_modules() -> dict:
    return {name: module for name, module in list(sys.modules.items())
            if module is not None and name.split(".")[0] in _OWN_PACKAGES}  # fmt: skip


# torch.nn's hooks on every module (`register_module_forward_hook` and its kin), emptied after each task.
_GLOBAL_MODULE_HOOKS = [
    name for name in vars(torch.nn.modules.module) if name.startswith("_global_") and name.endswith("_hooks")
]


class _FreshState:
    """What a worker held when it was forked, set back after each task; `leaks()` names what cannot be."""

    def __init__(self):
        self.torch_rng = torch.get_rng_state()
        self.python_rng = random.getstate()
        numpy = sys.modules.get("numpy")
        self.numpy_rng = numpy.random.get_state() if numpy is not None else None
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.warnings = list(warnings.filters)
        self.handlers = {signum: signal.getsignal(signum) for signum in _SIGNALS}
        self.threads = set(threading.enumerate())
        self.attributes = {name: dict(vars(module)) for name, module in _own_modules().items()}

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        numpy = sys.modules.get("numpy")
        if self.numpy_rng is not None and numpy is not None:
            numpy.random.set_state(self.numpy_rng)
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        warnings.filters[:] = self.warnings
        for signum, handler in self.handlers.items():
            if handler is not None:
                signal.signal(signum, handler)
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)
        torch.set_grad_enabled(True)
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        for name in _GLOBAL_MODULE_HOOKS:
            getattr(torch.nn.modules.module, name).clear()
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].reset()
        _forget_meshes()
        for name, module in _own_modules().items():
            saved = self.attributes.setdefault(name, dict(vars(module)))  # a module a task imported: as it is now
            current = vars(module)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    setattr(module, key, value)

    def leaks(self) -> list[str]:
        found = []
        if torch._C._len_torch_function_stack():
            found.append("a torch function mode is still active")
        if torch._C._len_torch_dispatch_stack():
            found.append("a torch dispatch mode is still active")
        if torch.is_autocast_enabled() or torch.is_autocast_enabled("cpu"):
            found.append("autocast is still on")
        if torch.is_inference_mode_enabled():
            found.append("inference mode is still on")
        if dist.is_initialized():
            found.append("a process group is still initialised")
        threads = [t for t in threading.enumerate() if t not in self.threads and t.is_alive()]
        for thread in threads:
            thread.join(timeout=2.0)
        threads = [t.name for t in threads if t.is_alive()]
        if threads:
            found.append(f"threads still running: {threads}")
        return found


def _forget_meshes() -> None:
    """Empties torch's caches that outlive a task's meshes. Group names restart at every new default group, so a
    DTensor sharding cached in one task (by the Python and the C++ propagator, keyed by meshes that compare equal
    across tasks) would name another task's group: "Could not resolve the process group registered under the name
    5" in test_fsdp's sequence-parallel case, after an earlier task of its pool."""
    if "torch.distributed.tensor" in sys.modules:
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
        torch._C._clear_DTensor_sharding_propagator_cache()
    from torch.distributed.device_mesh import _mesh_resources

    _mesh_resources.mesh_stack.clear()


def _destroy_every_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()  # the default group, and with it every group made from it


def _worker_main(rank: int, world_size: int, init: Callable, pipe) -> None:
    """A pooled rank: for each `(task_id, fn, args, timeout, port)` it receives on `pipe`, joins a new default group
    with `init(rank, world_size, port, timeout)` (rank 0 hosts its store on `port`, as a fresh rank 0 does), runs
    `fn`, destroys every group and sends back `(task_id, status, payload, leaks)`; until it receives None or the
    pool's owner is gone."""
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
    gc.freeze()  # the fork server's imports: out of every task's collections, which would walk (and copy) them
    torch.set_num_threads(1)
    timing.time_phases()  # before the state is taken: the wrappers stay for every task
    fresh = _FreshState()
    while True:
        try:
            task = pipe.recv()
        except EOFError:
            return
        if task is None:
            return
        task_id, fn, args, timeout, port = task
        os.environ["MASTER_PORT"] = str(port)
        try:
            init(rank, world_size, port, timeout)
        except Exception:  # noqa: BLE001 - the parent decides whether to retry on another port
            payload = ("rendezvous failed", traceback.format_exc())
        else:
            try:
                started = time.monotonic()
                result = pickle.dumps(fn(rank, world_size, *args))
                payload = ("ok", (result, (started, time.monotonic(), timing.phases_spent())))
            except BaseException:  # noqa: BLE001 - everything goes back to the parent
                payload = ("error", traceback.format_exc())
        try:
            _destroy_every_group()
        except Exception:  # noqa: BLE001 - a group that cannot be destroyed is a leak, found below
            pass
        try:
            fresh.restore()
            leaks = fresh.leaks()
        except Exception as error:  # noqa: BLE001 - a state that cannot be set back retires the pool
            leaks = [f"setting the state back failed: {error!r}"]
        pipe.send((task_id, *payload, leaks))


class RendezvousFailed(RuntimeError):
    """A rank could not join its group; nothing of the test's function ran (a pool it was in has been killed)."""


class RankPool:
    """`world_size` pooled ranks (see the module's docstring)."""

    def __init__(self, ctx, world_size: int, init: Callable):
        self.world_size = world_size
        self.pipes, self.procs = [], []
        for rank in range(world_size):
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(rank, world_size, init, child_end), daemon=True)
            proc.start()
            child_end.close()
            self.pipes.append(parent_end)
            self.procs.append(proc)
        self.tasks_run = 0
        self.retired: str | None = None  # why the pool takes no further task

    def usable(self) -> bool:
        return self.retired is None and all(proc.is_alive() for proc in self.procs)

    def run(self, fn: Callable, args: tuple, timeout: float, port: int) -> tuple[list[Any], list[tuple]]:
        """`fn(rank, world_size, *args)` on every worker; each rank's result and (start, end) in `fn`, by rank.
        Raises as `run_on_ranks` does, with the test's name; a timeout or a dead worker kills the pool."""
        task_id = self.tasks_run
        self.tasks_run += 1
        test = current_test()
        try:
            for pipe in self.pipes:
                pipe.send((task_id, fn, args, timeout, port))
        except (BrokenPipeError, OSError) as error:
            self.kill(f"a worker was gone before {test}")
            raise RuntimeError(f"{test}: the pool of {self.world_size} ranks was broken ({error})") from None
        outputs: dict[int, tuple[str, Any]] = {}
        failure = None
        deadline = time.monotonic() + timeout
        closed: set[int] = set()  # ranks whose pipe ended: the worker died (a closed pipe is always ready to read)
        while len(outputs) < self.world_size:
            waiting = {
                self.pipes[rank]: rank for rank in range(self.world_size) if rank not in outputs and rank not in closed
            }
            ready = connection.wait(list(waiting), timeout=1.0)
            for pipe in ready:
                rank = waiting[pipe]
                try:
                    got_id, status, payload, leaks = pipe.recv()
                except (EOFError, OSError):
                    closed.add(rank)  # the worker died: found below
                    continue
                if got_id != task_id:
                    continue
                if status == "rendezvous failed":
                    self.kill(f"rank {rank} could not join the group of {test}")
                    raise RendezvousFailed(payload)
                outputs[rank] = (status, payload)
                if leaks and not self.retired:
                    self.retired = f"{test} left on rank {rank}: {'; '.join(leaks)}"
                if status == "error" and failure is None:
                    failure = f"{test}: rank {rank} of {self.world_size} failed:\n{payload}"
                    deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE)
            missing = sorted(set(range(self.world_size)) - set(outputs))
            dead = [rank for rank in missing if rank in closed or not self.procs[rank].is_alive()]
            if dead and (closed or not ready):
                for rank in dead:
                    self.procs[rank].join(timeout=5)  # its pipe can end a moment before its exit status is known
                codes = [self.procs[rank].exitcode for rank in dead]
                self.kill(f"ranks {dead} died in {test}")
                raise RuntimeError(failure or f"{test}: ranks {dead} exited with codes {codes}") from None
            if missing and time.monotonic() > deadline:
                self.kill(f"{test} did not finish")
                if failure:
                    raise RuntimeError(f"{failure}\n(ranks {missing} did not finish after it)") from None
                raise TimeoutError(f"{test}: ranks {missing} did not finish within {timeout:.0f}s") from None
        if failure:
            raise RuntimeError(failure)
        payloads = [outputs[rank][1] for rank in range(self.world_size)]
        return [pickle.loads(result) for result, _ in payloads], [span for _, span in payloads]

    def kill(self, why: str) -> None:
        self.retired = why
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for pipe in self.pipes:
            pipe.close()

    def close(self) -> None:
        """Ends the workers as they would end themselves (and kills any that do not)."""
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=5)
        self.kill("closed")


class Pools:
    """This pytest worker's pools, by world size, the least recently used evicted past MAX_POOLED_RANKS.

    Args:
        ctx: the multiprocessing context the workers are started from (the fork server).
        init: joins a worker into a task's group, `init(rank, world_size, port, timeout)`.
    """

    def __init__(self, ctx, init: Callable):
        self.ctx, self.init = ctx, init
        self.pools: OrderedDict[int, RankPool] = OrderedDict()

    def run(self, fn: Callable, world_size: int, args: tuple, timeout: float, port: int) -> tuple[list, list]:
        pool = self.pools.pop(world_size, None)
        if pool is not None and not pool.usable():
            pool.kill(pool.retired or "a worker died")
            pool = None
        if pool is None:
            while self.pools and sum(p.world_size for p in self.pools.values()) + world_size > MAX_POOLED_RANKS:
                self.pools.popitem(last=False)[1].close()
            pool = RankPool(self.ctx, world_size, self.init)
        self.pools[world_size] = pool
        try:
            return pool.run(fn, args, timeout, port)
        finally:
            if pool.retired:
                self.pools.pop(world_size, None)
                pool.kill(pool.retired)

    def close(self) -> None:
        while self.pools:
            self.pools.popitem()[1].close()
