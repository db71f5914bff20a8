"""Checkpoints written while training goes on (`torch.distributed.checkpoint` staged, then saved in the background).

`AsyncCheckpointWriter.submit` stages a copy of the state (`stage`: each tensor copied off the live parameters and
optimizer states into host memory, a DTensor kept a DTensor of the same layout) and returns: the training step that
asked for the checkpoint continues at once, and the next optimizer step cannot change what is being written. One
background thread per process then writes the staged copies, in the order they were submitted, with `dcp.save` over
a gloo process group of its own (the training's collectives run on their groups meanwhile), and finishes each the
way a synchronous save does (`tp_train.checkpoint.dcp.write`: written beside the checkpoint and renamed into place
by rank 0 once every rank's shards are there). So the previous checkpoint stays whole and loadable until the new
one is complete, and a process killed mid-write loses only the checkpoint being written.

DCP's own `DefaultStager` is not used: it reuses one host copy per tensor from one save to the next, which is right
with one save in flight only, and Lightning's ModelCheckpoint saves twice at a step (`last.ckpt` and a numbered one).

Other file operations on checkpoints (deleting one Lightning no longer keeps) go through the same queue, after
the writes submitted before them. `wait` blocks until everything submitted is done and re-raises a failed write;
the process waits so at its exit too (a `trainer.save_checkpoint` after `fit` is written whole).
"""

from __future__ import annotations

import atexit
import copy
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


class AsyncCheckpointWriter:
    """Writes checkpoints in the background, one after another (see the module docstring).

    Args:
        group: the process group the background writes synchronise over; created (gloo, every rank) when None. Its
            creation is a collective: every rank constructs the writer together.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.new_group(backend="gloo")
        self._jobs: queue.Queue[tuple[Callable[[], Any], Future]] = queue.Queue()
        self._pending: list[Future] = []
        # A daemon thread, which a job blocked on a dead rank cannot keep alive; what was submitted is still written
        # before a normal exit (atexit handlers run before daemon threads stop).
        threading.Thread(target=self._run, name="tp-train-checkpoint-writer", daemon=True).start()
        atexit.register(self.wait)

    def submit(self, write: Callable[..., None], state: dict[str, Any], *args: Any) -> None:
        """Stages `state` now, then calls `write(staged_state, *args, group=self.group)` in the background."""
        self._raise_failed()
        staged = stage(state)
        self.run_later(lambda: write(staged, *args, group=self.group))

    def run_later(self, job: Callable[[], Any]) -> None:
        """Runs `job` in the background after everything submitted before it."""
        future: Future = Future()
        self._pending.append(future)
        self._jobs.put((job, future))

    def wait(self) -> None:
        """Blocks until every submitted job is done; raises the first that failed."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    @property
    def busy(self) -> bool:
        return any(not future.done() for future in self._pending)

    def _raise_failed(self) -> None:
        done = [future for future in self._pending if future.done()]
        self._pending = [future for future in self._pending if not future.done()]
        for future in done:
            future.result()

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except BaseException as error:  # noqa: BLE001 - handed to the thread that waits
                future.set_exception(error)


def stage(value: Any) -> Any:
    """A copy of `value` (a nested state dict) whose tensors are host copies of its tensors, each DTensor a DTensor
    of the same mesh, placements and global shape around a copy of its local tensor."""
    if isinstance(value, DTensor):
        local = value.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(
            local, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: stage(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(stage(item) for item in value)
    return copy.deepcopy(value)
