"""Non-finite losses and gradients, handled the same way on every rank."""

from __future__ import annotations

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from tp_train.errors import NonFiniteError
from tp_train.parallel.sharding import local_part

ACTIONS = ("stop", "skip")
_LOSS, _GRADIENTS = 1, 2  # what a rank found, as bits
_FOUND = {_LOSS: "loss", _GRADIENTS: "gradients", _LOSS | _GRADIENTS: "loss and gradients"}


class NonFiniteGuard(L.Callback):
    """Stops the run, or skips the step, on every rank when any rank finds a non-finite loss or gradient.

    Args:
        action: "stop" (raise `NonFiniteError` naming the step) or "skip" (no update at that step, on any rank).
    """

    def __init__(self, action: str = "stop") -> None:
        if action not in ACTIONS:
            raise ValueError(f"nonfinite action={action!r}: use 'stop' (end the run naming the step) or 'skip'")
        self.action = action
        self.skipped_steps: list[int] = []
        self._loss_found: torch.Tensor | None = None  # on the device: no sync per micro-batch

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        found = ~torch.isfinite(loss.detach()).all()
        self._loss_found = found if self._loss_found is None else self._loss_found | found

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = [param for group in optimizer.param_groups for param in group["params"]]
        found = self._found_per_rank(trainer, params)
        self._loss_found = None
        if not any(found):
            return
        step = trainer.global_step
        where = "; ".join(f"rank {rank}: {_FOUND[code]}" for rank, code in enumerate(found) if code)
        if self.action == "stop":
            raise NonFiniteError(
                f"non-finite values at global step {step} ({where}); stopped on every rank. Lower the learning rate, "
                f"clip gradients, or set nonfinite=skip to skip such steps"
            )
        for param in params:
            param.grad = None  # the optimizer skips parameters without gradients: no update, no state change
        self.skipped_steps.append(step)
        rank_zero_warn(f"skipped global step {step} on every rank: non-finite values ({where})")

    def _found_per_rank(self, trainer: L.Trainer, params: list[torch.Tensor]) -> list[int]:
        """What each rank found (bits `_LOSS`, `_GRADIENTS`), agreed over the world by one all-reduce."""
        device = trainer.strategy.root_device
        code = torch.zeros((), device=device)
        if self._loss_found is not None:
            code = code + _LOSS * self._loss_found.to(device)
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        grads = [local_part(param.grad) for param in params if param.grad is not None]  # FSDP2: this rank's piece
        if grads and (scaler is None or not scaler.is_enabled()):
            largest = torch.nn.utils.get_total_norm(grads, norm_type=float("inf"))  # inf or NaN if any is
            code = code + _GRADIENTS * (~torch.isfinite(largest)).to(device)
        if not (dist.is_available() and dist.is_initialized()):
            return [int(code.item())]
        found = torch.zeros(dist.get_world_size(), device=device)
        found[dist.get_rank()] = code
        dist.all_reduce(found)  # the whole world: tensor- and data-parallel peers must all agree
        return [int(value) for value in found.tolist()]
