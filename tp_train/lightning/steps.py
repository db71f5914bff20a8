"""How `TensorParallelStrategy` runs the user's step methods: through one step runner, chosen once at setup
(`tp_train.lightning.pipeline.step_runner`), that every step hook calls the same way, with Lightning's own hook as
`default`; so no hook asks whether there is a pipeline. Two runners have this interface: `ModelSteps` here (no
pipeline: Lightning's own steps) and `tp_train.lightning.pipeline.PipelineSteps` (the user's steps through the
pipeline's schedule)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch

from tp_train.training import ParallelTraining


class ModelSteps:
    """Lightning's own steps: the user's step methods call the model (DDP or FSDP2 around it reduces the gradients
    in backward), and the loss logged is the batch's (`ParallelTraining.batch_loss`: over the data x context parallel
    ranks, each rank's weighted by its targets). Before setup, `training` is None: each rank's own."""

    def __init__(self, training: ParallelTraining | None = None) -> None:
        self.training = training

    def training_step(self, default: Callable, *args: Any, **kwargs: Any) -> Any:
        """The step as Lightning runs it: `default(*args, **kwargs)` (the same for every step method)."""
        return default(*args, **kwargs)

    validation_step = test_step = predict_step = training_step

    def backward(self, default: Callable, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return default(closure_loss, *args, **kwargs)

    def count_targets(self, target: torch.Tensor, ignore_index: int) -> None:
        """Nothing to count: the strategy's loss counts the step's targets (`StrategyLoss.count`)."""

    def batch_loss(self, loss: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
        """The batch's loss from this rank's `loss`, weighted by `weight` (its targets) among the replicas'."""
        return loss if self.training is None else self.training.batch_loss(loss, weight)


def batch_arguments(args: tuple, kwargs: dict) -> tuple[Any, int]:
    """(batch, batch_idx) from a step hook's arguments."""
    batch = args[0] if args else kwargs["batch"]
    return batch, args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)


@contextmanager
def logs_kept(module: pl.LightningModule, into: list) -> Iterator[None]:
    """Within, `module.log(name, value, **kwargs)` appends (name, value, kwargs) to `into` instead of logging."""

    def record(name, value, *args, **kwargs):
        into.append((name, value, kwargs))

    module.log = record
    try:
        yield
    finally:
        del module.log
