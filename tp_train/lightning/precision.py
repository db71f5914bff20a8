"""Lightning precision plugins made tensor-parallel aware."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from typing_extensions import override

from tp_train.training.parallel_training import ClippingGroups


class _TensorParallelClipping:
    """Mixin: `clip_grad_by_norm` with the norm of the whole (unsharded) model, over the groups the strategy sets once
    the model is parallelized (`clipping`); `last_grad_norm` keeps the norm of the last clipped step."""

    clipping: ClippingGroups | None = None
    last_grad_norm: torch.Tensor | None = None

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self.clipping is None:
            raise RuntimeError("the tensor-parallel precision plugin was used before the strategy's setup()")
        self.last_grad_norm = self.clipping.clip_(self.main_params(optimizer), clip_val)


class TensorParallelPrecision(_TensorParallelClipping, Precision):
    """`32-true` under tensor parallelism."""


class TensorParallelDoublePrecision(_TensorParallelClipping, DoublePrecision):
    """`64-true` under tensor parallelism."""


class TensorParallelHalfPrecision(_TensorParallelClipping, HalfPrecision):
    """`16-true` / `bf16-true` under tensor parallelism."""


class TensorParallelMixedPrecision(_TensorParallelClipping, MixedPrecision):
    """`16-mixed` / `bf16-mixed` under tensor parallelism; fp16 scales the loss with a `ShardedGradScaler`."""

    def __init__(self, precision: str, device: str, scaler: torch.amp.GradScaler | None = None) -> None:
        if scaler is None and precision == "16-mixed":
            scaler = ShardedGradScaler(device=device)
        super().__init__(precision, device, scaler)


_COUNTERPARTS = {
    Precision: TensorParallelPrecision,
    DoublePrecision: TensorParallelDoublePrecision,
    HalfPrecision: TensorParallelHalfPrecision,
    MixedPrecision: TensorParallelMixedPrecision,
}


def tensor_parallel_precision(plugin: Precision) -> Precision:
    """The tensor-parallel counterpart of one of Lightning's precision plugins, with the same settings."""
    if isinstance(plugin, _TensorParallelClipping):
        return plugin
    counterpart = _COUNTERPARTS.get(type(plugin))
    if counterpart is None:
        supported = ", ".join(cls.__name__ for cls in _COUNTERPARTS)
        raise ValueError(
            f"precision plugin {type(plugin).__name__} is not supported by TensorParallelStrategy; use one of "
            f"{supported} (precision='32-true', '64-true', '16-true', 'bf16-true', '16-mixed' or 'bf16-mixed')"
        )
    converted = counterpart.__new__(counterpart)
    converted.__dict__.update(plugin.__dict__)
    scaler = getattr(converted, "scaler", None)
    if scaler is not None and not isinstance(scaler, ShardedGradScaler):
        kept = {key: getattr(scaler, f"get_{key}")() for key in ("growth_factor", "backoff_factor", "growth_interval")}
        converted.scaler = ShardedGradScaler(converted.device, scaler.get_scale(), enabled=scaler.is_enabled(), **kept)
    return converted


def fsdp_mixed_precision_policy(plugin: Precision) -> MixedPrecisionPolicy:
    """FSDP2 gathers parameters in the autocast dtype under mixed precision and reduces gradients in fp32; under
    `-true` precisions the parameters already have their dtype."""
    if isinstance(plugin, MixedPrecision):
        dtype = torch.bfloat16 if plugin.precision == "bf16-mixed" else torch.float16
        return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()
