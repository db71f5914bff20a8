"""Preemption: on SIGTERM or SIGUSR1, save a checkpoint at the end of the current training step and stop."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

import lightning as L
import torch
from lightning.pytorch.utilities.exceptions import SIGTERMException


class Preempted(SIGTERMException):
    """Raised on every rank after the preemption checkpoint is saved; uncaught, the process exits with status 0."""

    def __init__(self, step: int, checkpoint: Path, signal_name: str):
        self.step, self.checkpoint = step, checkpoint
        super().__init__(
            f"{signal_name}: stopped after step {step}, checkpoint saved to {checkpoint}; "
            f"rerun the same command to resume"
        )
        self.code = 0  # a clean exit: the run can be resumed


class PreemptionCheckpoint(L.Callback):
    """Saves `last.ckpt` (in the ModelCheckpoint's directory) and stops when a signal arrives during training.

    Args:
        signals: names of the signals that request it.
        check_every_n_steps: how often the ranks agree on the flag (one all-reduce of a scalar).
    """

    def __init__(self, signals: tuple[str, ...] | list[str] = ("SIGTERM", "SIGUSR1"), check_every_n_steps: int = 1):
        if check_every_n_steps < 1:
            raise ValueError(f"check_every_n_steps={check_every_n_steps} must be at least 1")
        self.signals = [signal.Signals[name] for name in signals]
        self.check_every_n_steps = check_every_n_steps
        self.received: signal.Signals | None = None  # the first signal this rank received
        self._previous_handlers: dict[signal.Signals, object] = {}
        self._last_checked_step = -1
        self._stop: Preempted | None = None  # saved; raised at the next hook

    def _install(self, *hook_arguments, **hook_keywords) -> None:
        # Called after Lightning registered its handlers (trainer._run), so these take their place until teardown.
        if self._previous_handlers or threading.current_thread() is not threading.main_thread():
            return  # installed already, or not allowed: Python installs handlers from the main thread only
        self.received, self._stop = None, None
        self._previous_handlers = {signum: signal.signal(signum, self._on_signal) for signum in self.signals}

    on_sanity_check_start = on_train_start = _install

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.received = self.received or signal.Signals(signum)  # nothing else here: a handler runs between bytecodes

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_checked_step or step % self.check_every_n_steps:
            return  # no optimizer step since the last check (gradient accumulation), or not a check step
        self._last_checked_step = step
        seen = torch.tensor([0.0 if self.received is None else float(self.received)], device=pl_module.device)
        agreed = int(trainer.strategy.reduce(seen, reduce_op="max").item())  # every rank, every check step
        if agreed:
            path = self._checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            self._stop = Preempted(step, path, signal.Signals(agreed).name)

    def _raise_if_stopping(self, *hook_arguments, **hook_keywords) -> None:
        # At the next hook rather than at once, so that Lightning still logs the step's metrics. A run whose last
        # step it was simply ends.
        if self._stop is not None:
            stop, self._stop = self._stop, None
            raise stop

    on_train_batch_start = on_validation_start = on_train_epoch_end = _raise_if_stopping

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers = {}

    @staticmethod
    def _checkpoint_path(trainer: L.Trainer) -> Path:
        """`last.ckpt` where ModelCheckpoint keeps it, which is where a rerun of the command looks."""
        callback = trainer.checkpoint_callback
        if callback is None or callback.dirpath is None:
            return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
        path = Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        callback.last_model_path = str(path)  # before saving: it is part of the callback's saved state
        return path
