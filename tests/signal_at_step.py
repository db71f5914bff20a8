"""Runs train.py as `python tests/signal_at_step.py STEP SIGNAL [overrides...]`: at the end of optimizer step STEP the
launching process (global rank 0, which a user or a cluster signals) sends itself a real SIGNAL (e.g. SIGTERM).
The overrides, and so the command that auto-resume compares, are exactly train.py's: the signal is not config."""

from __future__ import annotations

import os
import runpy
import signal
import sys
from pathlib import Path

import lightning as L

ROOT = Path(__file__).resolve().parents[1]


class SignalAtStep(L.Callback):
    """Global rank `rank` sends itself `signum` after optimizer step `step` (after that step's preemption check)."""

    def __init__(self, step: int, signum: signal.Signals, rank: int = 0):
        self.step, self.signum, self.rank = step, signum, rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)


def main() -> None:
    step, name, *overrides = sys.argv[1:]
    fit = L.Trainer.fit

    def fit_and_signal(trainer, *args, **kwargs):
        trainer.callbacks.append(SignalAtStep(int(step), signal.Signals[name]))
        return fit(trainer, *args, **kwargs)

    L.Trainer.fit = fit_and_signal
    sys.argv = [str(ROOT / "train.py"), *overrides]  # what the child ranks re-run: plain train.py
    sys.path[0] = str(ROOT)  # as `python train.py` has it: this worktree's tp_train
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
