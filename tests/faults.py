"""Faults injected into real training runs, as callbacks that `train.py` instantiates from the command line:

    python train.py ... +callbacks.fault._target_=tests.faults.FailAtStep +callbacks.fault.rank=1 \
        +callbacks.fault.step=3 +callbacks.fault.how=sigkill +callbacks.fault.record=/tmp/fault.json

Every rank builds the callback (each re-runs the same command); only `rank` acts, at the start of global step
`step`. It first writes {"pid": ..., "time": ...} to `record` so that a test can time how long the job took to end.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import lightning as L


class FailAtStep(L.Callback):
    """Rank `rank` dies at global step `step`: `how` is "sigkill" (a real SIGKILL of its own process) or "raise"."""

    def __init__(self, rank: int, step: int, how: str, record: str) -> None:
        if how not in ("sigkill", "raise"):
            raise ValueError(f"how={how!r}: use 'sigkill' or 'raise'")
        self.rank, self.step, self.how, self.record = rank, step, how, Path(record)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        self.record.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
        if self.how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")
