"""`numerics="invariant"` over data-parallel replicas inside `TensorParallelStrategy`: the user's `training_step` runs
unchanged, once per leaf of the batch (`tp_train.training.leaves`), and the leaves' gradients are summed in their
fixed order over the replicas; no DDP wraps the model.

How one step goes: the batch this rank's sampler dealt (Lightning's `DistributedSampler`: positions r, r + dp, ... of
the global batch) is cut into its leaves; `training_step` runs on each, its forward and backward alone; the gradients
and the loss are summed in the leaves' tree (`ParallelTraining.backward_in_leaves`). What `training_step` logged is
logged once: its loss as the batch's, any other value as its mean over the leaves. As under a pipeline, the runner
owns backward: Lightning's `backward` (after its `zero_grad`) only sets the gradients the leaves summed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.strategies import Strategy

from tp_train.lightning.steps import ModelSteps, batch_arguments, logs_kept
from tp_train.training import ParallelTraining


class LeafSteps(ModelSteps):
    """The strategy's step runner under `numerics="invariant"`, at every dp (the interface of
    `tp_train.lightning.steps.ModelSteps`); validation, test and predict run as Lightning runs them."""

    def __init__(self, strategy: Strategy, training: ParallelTraining) -> None:
        super().__init__(training)
        self.strategy = strategy
        self.module = strategy.lightning_module
        self._pending: dict[torch.nn.Parameter, torch.Tensor] = {}  # the step's gradients, until backward

    def training_step(self, default: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The user's training_step on each leaf of the batch, forward and backward; returns the batch's loss (over
        the replicas too) on every rank; the gradients wait for `backward`."""
        batch, batch_idx = batch_arguments(args, kwargs)
        if not isinstance(batch, torch.Tensor):
            raise ValueError(
                f"numerics='invariant' cuts the batch into leaves of samples: it takes a batch that is one "
                f"tensor of samples, not {type(batch).__name__}"
            )
        if getattr(self.strategy.precision_plugin, "scaler", None) is not None:
            raise ValueError("numerics='invariant' runs without a gradient scaler: use precision=bf16, 32 or 64")
        logged: list[list[tuple[str, Any, dict]]] = []

        def loss_of(samples: torch.Tensor) -> torch.Tensor:
            entries: list[tuple[str, Any, dict]] = []
            with logs_kept(self.module, entries):
                result = default(samples, batch_idx)
            loss = result["loss"] if isinstance(result, dict) else result
            logged.append([(name, value is result or value is loss, value, kw) for name, value, kw in entries])
            return loss

        loss = self.training.backward_in_leaves(batch, loss_of)
        # Lightning zeroes the gradients after training_step and before backward: this step's wait for `backward`
        self._pending = {param: param.grad for param in self.module.parameters() if param.grad is not None}
        for param in self._pending:
            param.grad = None
        for position, (name, is_loss, _, kw) in enumerate(logged[0]):
            values = [float(torch.as_tensor(entries[position][2]).float().mean()) for entries in logged]
            self.module.log(name, loss if is_loss else torch.tensor(sum(values) / len(values)), **kw)
        return loss

    def backward(self, default: Callable, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The leaves ran backward in training_step; their gradients land now, between the precision plugin's hooks
        (on_before_backward, on_after_backward for the callbacks)."""
        precision, module = self.strategy.precision_plugin, self.module
        if module.trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"numerics='invariant' sums a batch's leaves in one tree: accumulate_grad_batches="
                f"{module.trainer.accumulate_grad_batches} would add the batches' sums in turn; give a larger batch"
            )
        closure_loss = precision.pre_backward(closure_loss, module)
        for param, grad in self._pending.items():
            param.grad = grad
        self._pending = {}
        self.strategy.post_backward(closure_loss)  # the strategy's own (after_backward), before the callbacks
        precision.post_backward(closure_loss, module)
        return closure_loss

    def batch_loss(self, loss: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
        """`loss` itself in a training step (the batch's is logged after the leaves); the replicas' weighted mean in
        validation, as Lightning's own steps log it."""
        return loss if self.module.training else super().batch_loss(loss, weight)
