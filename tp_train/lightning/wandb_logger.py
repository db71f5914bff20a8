"""Lightning's `WandbLogger`, minus one argument: Lightning 2.6 always passes `anonymous` to `wandb.init` (None when
unset), and wandb 0.2x prints "The anonymous setting has no effect and will be removed" on every run for any value
but its own unset marker. The argument does nothing in those wandb versions, so it is dropped when unset.

And W&B never ends a run: a `wandb.init` or a log call that raises (no network for an online run, a full disk, a
service that died) is one warning, and the run goes on without W&B (issue 41)."""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from typing_extensions import override

from tp_train.lightning.best_effort import BestEffort

W_AND_B = "logging to W&B"  # one piece: after its first failure nothing more is sent
WITHOUT = "nothing more is sent to W&B"


def _best_effort(name: str):
    """Lightning's `WandbLogger.<name>`, run through the logger's `BestEffort`."""
    method = getattr(LightningWandbLogger, name)

    @functools.wraps(method)
    def logged(self, *args: Any, **kwargs: Any) -> None:
        self._optional(W_AND_B, lambda: method(self, *args, **kwargs), WITHOUT, every_rank=True)

    return logged


class WandbLogger(LightningWandbLogger):
    """`lightning.pytorch.loggers.WandbLogger` with the same arguments (see its docs); its log calls are best
    effort (`BestEffort`): the first that raises is one warning, and later ones are skipped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self._optional = BestEffort(type(self).__name__)

    @property
    @override
    def experiment(self) -> Any:
        """W&B's run (`wandb.init` at the first call), or None once W&B has failed."""
        return self._optional(W_AND_B, lambda: LightningWandbLogger.experiment.fget(self), WITHOUT, every_rank=True)

    @property
    def failed(self) -> str | None:
        """Why W&B stopped receiving this run's logs (its first error), or None."""
        return self._optional.failed.get(W_AND_B)

    # Lightning's own calls, each best effort
    log_metrics = _best_effort("log_metrics")
    log_hyperparams = _best_effort("log_hyperparams")
    log_text = _best_effort("log_text")
    log_table = _best_effort("log_table")
    after_save_checkpoint = _best_effort("after_save_checkpoint")
    finalize = _best_effort("finalize")
