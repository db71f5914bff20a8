"""Lightning's `WandbLogger`, minus one argument: Lightning 2.6 always passes `anonymous` to `wandb.init` (None when
unset), and wandb 0.2x prints "The anonymous setting has no effect and will be removed" on every run for any value
but its own unset marker. The argument does nothing in those wandb versions, so it is dropped when unset."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """`lightning.pytorch.loggers.WandbLogger` with the same arguments (see its docs)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
