"""`TensorParallelStrategy`'s arguments checked before anything starts: each wrong one refused in one line naming it,
its value and what would work."""

from __future__ import annotations

import inspect
from typing import Any

from torch.nn.parallel import DistributedDataParallel

from tp_train.parallel.context_parallel import ROTATIONS
from tp_train.parallel.dims import check_shard_mode
from tp_train.parallel.invariant import FAST, INVARIANT, check_numerics
from tp_train.parallel.mesh import DATA_PARALLEL_MODES
from tp_train.parallel.pipeline import schedule_named


def check_arguments(
    tensor_parallel_size: int, context_parallel_size: int, rotation: str, data_parallel: str, kwargs: dict[str, Any]
) -> None:
    """Raises ValueError / TypeError for sizes that are not positive integers, an unknown rotation or data-parallel
    mode, and keyword arguments that are not DistributedDataParallel's (or any with FSDP)."""
    sizes = {"tensor_parallel_size": tensor_parallel_size, "context_parallel_size": context_parallel_size}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r} must be a positive integer")
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"data_parallel={data_parallel!r}: use 'ddp' (replicated tensor-parallel shards) or 'fsdp' "
            f"(shards, gradients and optimizer states sharded over the data-parallel ranks)"
        )
    if data_parallel == "fsdp" and kwargs:
        raise TypeError(
            f"TensorParallelStrategy(data_parallel='fsdp') got DistributedDataParallel arguments {sorted(kwargs)}; "
            f"they apply with data_parallel='ddp' only"
        )
    unknown = sorted(set(kwargs) - set(inspect.signature(DistributedDataParallel).parameters))
    if unknown:  # checked here: at dp=1 there is no DDP to reject them
        raise TypeError(
            f"TensorParallelStrategy got unknown arguments {unknown}; other keyword arguments go to torch's "
            f"DistributedDataParallel (e.g. bucket_cap_mb, gradient_as_bucket_view)"
        )
    if rotation not in ROTATIONS:
        raise ValueError(
            f"TensorParallelStrategy(context_parallel_rotation={rotation!r}): use one of "
            f"{', '.join(map(repr, ROTATIONS))} (docs/long-sequences.md)"
        )


def check_fused_loss(fused_loss: bool | None, data_parallel: str, numerics: str = FAST) -> None:
    """Raises ValueError for an unknown `numerics`, and a fused head and loss forced on with FSDP or with
    numerics="invariant"."""
    if check_numerics(numerics, "TensorParallelStrategy") == INVARIANT and fused_loss:
        raise ValueError(
            "TensorParallelStrategy(fused_loss=True) with numerics='invariant': the fused head and loss sum in "
            "their own order; use fused_loss=None"
        )
    if fused_loss and data_parallel == "fsdp":
        raise ValueError(
            "TensorParallelStrategy(fused_loss=True) with data_parallel='fsdp': FSDP frees the head's gathered "
            "weight when the forward ends, before the loss; use data_parallel='ddp' or fused_loss=None"
        )


def check_shard_size(data_parallel_shard_size: int | None, data_parallel: str) -> None:
    """Raises ValueError for a shard size that is not a positive integer, or is given without FSDP (HSDP shards)."""
    if data_parallel_shard_size is None:
        return
    size = data_parallel_shard_size
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"data_parallel_shard_size={size!r} must be a positive integer dividing dp, e.g. 2")
    check_shard_mode(size, data_parallel, "data_parallel_shard_size", unset="None")


def check_pipeline_arguments(size: int, schedule: str, microbatches: int | None, virtual_stages: int = 1) -> None:
    """One-line `ValueError` for pipeline arguments the strategy cannot run (yet), before any rank starts."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"pipeline_parallel_size={size!r} must be a positive integer")
    if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
        raise ValueError(f"pipeline_microbatches={microbatches!r} must be a positive integer")
    if size == 1:
        return
    named = schedule_named(schedule, virtual_stages)  # unknown or refused, or stages it cannot use: its one line
    stages, microbatches = size * virtual_stages, microbatches or size  # the strategy's default: one per rank
    if named.microbatch_per_stage and microbatches < stages:
        raise ValueError(
            f"pipeline_schedule={schedule!r} needs at least as many microbatches as stages ({size} x {virtual_stages} "
            f"virtual = {stages}), got pipeline_microbatches={microbatches}; use pipeline_microbatches={stages}"
        )
