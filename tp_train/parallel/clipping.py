"""Gradient-norm clipping with the true global norm of a tensor-parallel model."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from tp_train.parallel import invariant
from tp_train.parallel.sharding import ShardSpec, data_parallel_split, local_part, replicated_rows
from tp_train.parallel.widening import statistics_dtype, widened


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    sharded: Collection[int] | Mapping[int, ShardSpec],
    group: ProcessGroup,
    norm_type: float = 2.0,
    experts: tuple[Collection[int], ProcessGroup] | None = None,
) -> torch.Tensor:
    """The norm of all gradients as if the model were unsharded (collectives over `group` and, for DTensor
    parameters, over their data-parallel mesh, and, with `experts`, over the expert-parallel group).

    Args:
        parameters: the parameters whose `.grad` count; those without a gradient are skipped.
        sharded: `id()` of the parameters that are tensor-parallel shards, or a mapping from it to their
            `ShardSpec` (needed where kv heads are replicated, so that each counts once).
        group: the tensor-parallel process group.
        norm_type: 2.0 or `inf`.
        experts: `id()` of the parameters holding this rank's run of experts (whole on every tensor-parallel rank)
            and the expert-parallel group, whose ranks hold the other runs: each expert counts once.
    """
    if experts is not None and experts[0]:
        expert_ids, expert_group = experts
        parameters = list(parameters)
        dense = [p for p in parameters if id(p) not in expert_ids]
        total = global_grad_norm(dense, sharded, group, norm_type)
        own = global_grad_norm([p for p in parameters if id(p) in expert_ids], (), group, norm_type).reshape(1)
        if norm_type == 2.0:
            own = own.square()
        dist.all_reduce(own, op=dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX, group=expert_group)
        return (total.square() + own[0]).sqrt() if norm_type == 2.0 else torch.maximum(total, own[0])
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"norm_type={norm_type} is not supported with tensor parallelism; use 2.0 or inf")
    parameters = list(parameters)
    # (tensor-parallel shard?, data-parallel shard?) -> this rank's gradient pieces
    buckets: dict[tuple[bool, bool], list[torch.Tensor]] = {key: [] for key in _BUCKETS}
    for p in parameters:
        if p.grad is not None:
            buckets[(id(p) in sharded, isinstance(p, DTensor))].append(local_part(p.grad.detach()))
    # Where the reduction runs: with the parameters (NCCL needs the GPU), even on a rank with no gradients.
    device = local_part(parameters[0]).device if parameters else torch.device("cpu")
    # The norm's dtype: float32, or float64 for float64 parameters (a float32 norm would round their clipping)
    dtype = statistics_dtype(parameters[0].dtype if parameters else torch.get_default_dtype())
    # FSDP2's data-parallel group: where its DTensors split (HSDP's replicate axis holds copies, counted once)
    fully_sharded = next((p for p in parameters if isinstance(p, DTensor)), None)
    data_parallel = None
    if fully_sharded is not None:
        data_parallel = fully_sharded.device_mesh.get_group(data_parallel_split(fully_sharded)[0])

    def part(key: tuple[bool, bool]) -> torch.Tensor:
        grads = buckets[key]
        if not grads:
            return torch.zeros((), device=device, dtype=dtype)
        if norm_type == 2.0:
            return _squared_norm(grads).to(device, dtype)
        return torch.nn.utils.get_total_norm(grads, norm_type).to(device, dtype)

    op = dist.ReduceOp.SUM if norm_type == 2.0 else dist.ReduceOp.MAX
    combine = torch.add if norm_type == 2.0 else torch.maximum
    tp_parts = [part((True, True)), part((True, False))]
    specs = sharded if isinstance(sharded, Mapping) else {}
    if norm_type == 2.0:  # a replicated kv head: each of its replicas adds 1/replicas of its square
        for p in parameters:
            spec = specs.get(id(p))
            if p.grad is not None and spec is not None and replicated_rows(spec, dist.get_world_size(group)):
                excess = _replicated_excess(p.grad.detach(), spec, group).to(device, dtype)
                tp_parts[0 if isinstance(p, DTensor) else 1] = tp_parts[0 if isinstance(p, DTensor) else 1] - excess
    over_tp = torch.stack(tp_parts)
    dist.all_reduce(over_tp, op=op, group=group)
    total = combine(over_tp[1], part((False, False)))
    if data_parallel is not None:  # every rank holds DTensors alike, so all of them join this reduction
        over_dp = combine(over_tp[0], part((False, True))).reshape(1)
        dist.all_reduce(over_dp, op=op, group=data_parallel)
        total = combine(total, over_dp[0])
    else:
        total = combine(total, over_tp[0])
    return total.sqrt() if norm_type == 2.0 else total


def _replicated_excess(grad: torch.Tensor, spec: ShardSpec, group: ProcessGroup) -> torch.Tensor:
    """What this rank's squared norm over-counts of the kv heads it replicates: (1 - 1/replicas) of their square.
    A DTensor gradient (FSDP2) is gathered over the data-parallel ranks first, each of which then adds 1/dp."""
    world_size, share = dist.get_world_size(group), 1.0
    if isinstance(grad, DTensor):
        share = 1 / grad.device_mesh.size(data_parallel_split(grad)[0])
        grad = grad.full_tensor()
    excess = torch.zeros((), device=grad.device, dtype=statistics_dtype(grad.dtype))
    for start, rows, copies in replicated_rows(spec, world_size):
        excess += (1 - 1 / copies) * widened(grad.narrow(spec.dim, start, rows)).square().sum()
    return excess * share


_BUCKETS = [(True, True), (True, False), (False, True), (False, False)]
CHUNK = 2**16  # elements per fp32 norm: one over millions drifts (1e-5 relative on CPU), one over 65,536 does not


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The sum of squares of `grads`, in float64: each tensor's norm taken in fp32 over chunks of `CHUNK` elements
    (views, no copy of a contiguous tensor), their squares summed in float64. torch's one fp32 norm over the 8M
    elements of gpt-oss's expert weights drifted by 1.4e-5 relative on CPU, and differently for a shard than for the
    whole tensor: the clipped steps of tp=2 and tp=1 ended 6.7e-4 apart in 4 steps (issue 41)."""
    small = [grad for grad in grads if grad.numel() <= CHUNK]
    norms = [torch.stack(torch._foreach_norm(small)).double()] if small else []
    for grad in grads:
        if grad.numel() > CHUNK:
            flat = grad.reshape(-1)
            whole = flat.numel() // CHUNK * CHUNK
            norms.append(torch.linalg.vector_norm(flat[:whole].view(-1, CHUNK), dim=1).double())
            norms.append(torch.linalg.vector_norm(flat[whole:]).double().reshape(1))
    return torch.cat(norms).square().sum()


def invariant_grad_norm(
    parameters: Iterable[torch.Tensor], sharded: Mapping[int, ShardSpec], group: ProcessGroup
) -> torch.Tensor:
    """The 2-norm of all gradients in `numerics="invariant"`'s order (`tp_train.parallel.invariant`), the same bits
    at every tensor-parallel degree: each gradient's squares summed over its last dimension, then over its first
    (a matrix; a vector is one column), in tiles, a split dimension's sum finished over `group`; the parameters'
    sums added in one tree, in the order given. Each parameter counts once (tied ones share a gradient). Sizes are
    global, as `invariant.row_sum` takes them."""
    parameters = list({id(p): p for p in parameters if p.grad is not None}.values())
    ranks = dist.get_world_size(group)
    squares = []
    for param in parameters:
        grad, spec = param.grad.detach(), sharded.get(id(param))
        if isinstance(grad, DTensor) or grad.dim() > 2:
            raise ValueError(
                f"clip_grad_norm_: numerics='invariant' takes plain 1-D and 2-D gradients, not "
                f"{type(grad).__name__} of shape {tuple(grad.shape)}; use numerics='fast'"
            )
        if spec is not None:
            if len(spec.sections) > 1 or replicated_rows(spec, ranks):
                raise ValueError(
                    f"clip_grad_norm_: numerics='invariant' takes parameters split evenly in one section; one of "
                    f"shape {tuple(grad.shape)} is split in sections {spec.sections}; use numerics='fast'"
                )
            invariant.check_split(spec.sections[0], ranks, "clip_grad_norm_'s sharded parameter")  # so: no padding
        matrix = widened(grad if grad.dim() == 2 else grad.reshape(-1, 1)).square()
        split = spec.dim if spec is not None else None
        height, width = (size * (ranks if split == dim else 1) for dim, size in enumerate(matrix.shape))
        rows = invariant.finish_sum(invariant.row_sum(matrix, width), group if split == 1 else None)
        total = invariant.column_sum(rows.unsqueeze(1), height)
        squares.append(invariant.finish_sum(total, group if split == 0 else None))
    if not squares:
        return torch.zeros((), dtype=statistics_dtype(torch.get_default_dtype()))
    return invariant.tree_sum(torch.cat(squares).double()).sqrt()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    sharded: Collection[int] | Mapping[int, ShardSpec],
    group: ProcessGroup,
    norm_type: float = 2.0,
    experts: tuple[Collection[int], ProcessGroup] | None = None,
    numerics: str = invariant.FAST,
) -> torch.Tensor:
    """Scales gradients in place so their global norm is at most `max_norm`; returns the norm before clipping
    (`experts` as for `global_grad_norm`; `numerics="invariant"`: `invariant_grad_norm`, the 2-norm, no experts)."""
    parameters = list(parameters)
    if invariant.check_numerics(numerics, "clip_grad_norm_") == invariant.INVARIANT:
        if norm_type != 2.0 or experts is not None and experts[0]:
            raise ValueError("clip_grad_norm_: numerics='invariant' takes norm_type=2.0 and no experts; use 'fast'")
        total = invariant_grad_norm(parameters, sharded if isinstance(sharded, Mapping) else {}, group)
        clip_grads_with_norm_(parameters, max_norm, total.to(parameters[0].dtype if parameters else total.dtype))
        return total
    total = global_grad_norm(parameters, sharded, group, norm_type, experts)
    clip_grads_with_norm_(parameters, max_norm, total)
    return total


def clip_grads_with_norm_(parameters: Iterable[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """torch's `clip_grads_with_norm_` on FSDP2's DTensors and on plain tensors (the experts it leaves whole)
    apart: its foreach ops take one kind at once."""
    parameters = list(parameters)
    for kind in (True, False):
        same = [p for p in parameters if isinstance(p, DTensor) is kind]
        if same:
            torch.nn.utils.clip_grads_with_norm_(same, max_norm, total)
