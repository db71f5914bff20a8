"""`BestEffort`: what a callback does beside the model's own computation (counting FLOPs, probing memory, logging
to W&B, drawing a samples table) must never end a run. Each such piece runs through one `BestEffort`; one that
raises is skipped from then on, with one warning naming what failed, why, and what is not logged."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn

T = TypeVar("T")


class BestEffort:
    """Runs the optional pieces of one callback. A piece that raises (any `Exception`) returns `default`, warns once
    and is not tried again in this run; the model's computation and the collectives never run through it.

    Args:
        owner: the callback's name, which each warning starts with.
    """

    def __init__(self, owner: str):
        self.owner = owner
        self.failed: dict[str, str] = {}  # piece -> why it failed (its exception, one line)

    def __call__(
        self, piece: str, action: Callable[[], T], consequence: str, default: T = None, every_rank: bool = False
    ) -> T:
        """`action()`, or `default` once `piece` has failed.

        Args:
            piece: what `action` does, in the warning ("counting FLOPs").
            consequence: what the run goes without ("MFU is not logged").
            every_rank: the piece fails alike on every rank (a meta-device count), or runs on rank 0 alone (a
                logger): rank 0 warns. Else the rank it failed on warns, naming itself.
        """
        if piece in self.failed:
            return default
        try:
            return action()
        except Exception as error:  # noqa: BLE001 - a metric or a log line never ends the run
            why = f"{type(error).__name__}: {' '.join(str(error).split())}"[:300]
            self.failed[piece] = why
            message = f"{self.owner}: {piece} failed ({why}); {consequence}; training goes on"
            if every_rank:
                rank_zero_warn(message)
            else:
                warnings.warn(f"rank {getattr(rank_zero_only, 'rank', 0)}: {message}", stacklevel=2)
            return default
