"""Activation checkpointing per transformer block (torch.utils.checkpoint, non-reentrant); each checkpointed forward
records `TensorParallelRNG`'s whole state and the recomputation replays it, so dropout draws the same masks."""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tp_train.parallel.random import TensorParallelRNG


class _CheckpointedForward:
    """Stands in for a block's `forward` (an instance attribute, so parameter names and hooks are unchanged)."""

    def __init__(self, block: nn.Module, rng: TensorParallelRNG):
        self.block, self.rng = block, rng

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = type(self.block).forward.__get__(self.block)
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        state = self.rng.get_state()
        return checkpoint(
            forward,
            *args,
            use_reentrant=False,
            preserve_rng_state=False,  # the RNG replays both streams itself
            context_fn=lambda: (nullcontext(), self.rng.replay(state)),
            **kwargs,
        )


def checkpoint_blocks(model: nn.Module, blocks: Iterable[str], rng: TensorParallelRNG) -> None:
    """Makes every block of `model` named in `blocks` (the plan's `BlockLayout.blocks`) recompute its forward in
    backward."""
    for name in blocks:
        block = model.get_submodule(name)
        block.forward = _CheckpointedForward(block, rng)
