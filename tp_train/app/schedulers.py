"""Learning-rate schedules."""

from __future__ import annotations

import math

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR


def _check(total_steps: int, warmup_steps: int) -> None:
    if total_steps < 1 or warmup_steps < 0:
        raise ValueError(
            f"scheduler: need total_steps >= 1 (got {total_steps}) and warmup_steps >= 0 (got {warmup_steps})"
        )


def constant_with_warmup(optimizer: Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr over `warmup_steps`, then the optimizer's lr (a factor of exactly
    1) to the end; with no warmup, the optimizer's lr throughout."""
    _check(total_steps, warmup_steps)
    warmup_steps = min(warmup_steps, total_steps)
    return LambdaLR(optimizer, lambda step: (step + 1) / warmup_steps if step < warmup_steps else 1.0)


def cosine_with_warmup(
    optimizer: Optimizer, total_steps: int, warmup_steps: int = 0, min_lr_ratio: float = 0.1
) -> LambdaLR:
    """Linear warmup from 0 to the optimizer's lr over `warmup_steps`, then cosine decay to `min_lr_ratio` x lr at
    `total_steps` (held there after). A run shorter than the warmup warms up over the whole run."""
    _check(total_steps, warmup_steps)
    warmup_steps = min(warmup_steps, total_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return LambdaLR(optimizer, factor)
