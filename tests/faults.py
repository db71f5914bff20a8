"""Faults injected into real training runs, as callbacks that `train.py` instantiates from the command line:

    python train.py ... +callbacks.fault._target_=tests.faults.FailAtStep +callbacks.fault.rank=1 \
        +callbacks.fault.step=3 +callbacks.fault.how=sigkill +callbacks.fault.record=/tmp/fault.json

Every rank builds the callback (each re-runs the same command); only `rank` acts, at the start of global step
`step`. It first writes {"pid": ..., "time": ...} to `record` so that a test can time how long the job took to end;
a fault whose record exists already does not fire again (the same command, rerun, resumes past it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import lightning as L


class FailAtStep(L.Callback):
    """Rank `rank` fails at global step `step`: `how` is "sigkill" (a real SIGKILL of its own process), "sigstop"
    (a real SIGSTOP: it hangs, as a stuck kernel or a dead link looks to its peers) or "raise"."""

    def __init__(self, rank: int, step: int, how: str, record: str) -> None:
        if how not in ("sigkill", "sigstop", "raise"):
            raise ValueError(f"how={how!r}: use 'sigkill', 'sigstop' or 'raise'")
        self.rank, self.step, self.how, self.record = rank, step, how, Path(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step or self.record.exists():
            return
        self.record.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        if self.how != "raise":
            os.kill(os.getpid(), signal.SIGKILL if self.how == "sigkill" else signal.SIGSTOP)
            return
        raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class StallAtStep(L.Callback):
    """Rank `rank` is slow for `seconds` at global step `step`, in the three places a hang detector must wait out:
    loading the next batch (after the step), in validation, and in a checkpoint save (from the save at or after
    `step`); each once."""

    def __init__(self, rank: int, step: int, seconds: float) -> None:
        self.rank, self.step, self.seconds = rank, step, seconds
        self.stalled: set[str] = set()

    def _stall(self, trainer, where: str) -> None:
        if trainer.global_rank == self.rank and trainer.global_step >= self.step and where not in self.stalled:
            self.stalled.add(where)
            print(f"stalling rank {self.rank} for {self.seconds} s in {where} at step {trainer.global_step}")
            time.sleep(self.seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._stall(trainer, "data")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._stall(trainer, "validation")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._stall(trainer, "save")
