"""Checkpoints written while training goes on (`torch.distributed.checkpoint` staged, then saved in the background)."""

from __future__ import annotations

import atexit
import copy
import queue
import threading
import weakref
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

    _live: weakref.WeakSet[AsyncCheckpointWriter] = weakref.WeakSet()  # every writer of this process

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        self.group = group if group is not None else dist.new_group(backend="gloo")
        AsyncCheckpointWriter._live.add(self)
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

    @classmethod
    def wait_all(cls) -> None:
        """Blocks until every writer of this process has written what it was given: a load may read what another
        trainer's strategy saved in the background (`trainer.save_checkpoint(path)` after `fit`, then a new trainer
        loading `path`)."""
        for writer in list(cls._live):
            writer.wait()

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
