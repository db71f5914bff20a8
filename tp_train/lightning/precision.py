"""Lightning precision plugins made tensor-parallel aware."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from typing_extensions import override

from tp_train.parallel.clipping import clip_grad_norm_, clip_grads_with_norm_, global_grad_norm
from tp_train.parallel.sharding import ShardSpec


class _TensorParallelClipping:
    """Mixin: `clip_grad_by_norm` with the norm of the whole (unsharded) model. The strategy sets the group and
    the shard ids once the model is sharded; `last_grad_norm` keeps the norm of the last clipped step."""

    tensor_parallel_group: ProcessGroup | None = None
    sharded_parameters: Mapping[int, ShardSpec] = MappingProxyType({})  # id(shard) -> how it is split
    last_grad_norm: torch.Tensor | None = None
    pipeline_parallel_group: ProcessGroup | None = None  # with pipeline stages: the norm is over all of them
    pipeline_duplicates: frozenset[int] = frozenset()  # id() of tied copies an earlier stage holds (counted once)
    experts: tuple[frozenset[int], ProcessGroup] | None = None  # expert parallelism: (id() of experts, ep group)

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: int | float) -> None:
        if self.tensor_parallel_group is None:
            raise RuntimeError("the tensor-parallel precision plugin was used before the strategy's setup()")
        if self.pipeline_parallel_group is not None:  # each stage's parameters are its own: summed over the stages
            params = list(self.main_params(optimizer))
            counted = [p for p in params if id(p) not in self.pipeline_duplicates]
            # this stage's norm over tp (and FSDP2's dp), then its square summed over the stages
            stage = global_grad_norm(counted, self.sharded_parameters, self.tensor_parallel_group, experts=self.experts)
            squared = stage.square().reshape(1)
            torch.distributed.all_reduce(squared, group=self.pipeline_parallel_group)
            norm = squared[0].sqrt()
            clip_grads_with_norm_(params, clip_val, norm)
            self.last_grad_norm = norm
            return
        self.last_grad_norm = clip_grad_norm_(
            self.main_params(optimizer), clip_val, self.sharded_parameters, self.tensor_parallel_group,
            experts=self.experts,
        )  # fmt: skip


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
