"""Gradient-norm clipping with the true global norm of a tensor-parallel model.

`torch.nn.utils.clip_grad_norm_` on one rank sees only that rank's shards, so each TP rank would clip by a
different, too-small norm. Here each sharded element counts once (squared norms of shards are summed over the TP
group) and each replicated parameter counts once (its gradient is the same on every TP rank); a kv head that
several TP ranks replicate (see `tp_train.parallel.sharding`) counts once too, each replica adding 1/replicas of its
square. Data-parallel replicas need no reduction: their gradients were already averaged, so they are equal.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.sharding import ShardSpec, replicated_rows


def global_grad_norm(
    parameters: Iterable[torch.Tensor],
    sharded: Collection[int] | Mapping[int, ShardSpec],
    group: ProcessGroup,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """The norm of all gradients as if the model were unsharded (a collective over `group`).

    Args:
        parameters: the parameters whose `.grad` count; those without a gradient are skipped.
        sharded: `id()` of the parameters that are tensor-parallel shards, or a mapping from it to their
            `ShardSpec` (needed where kv heads are replicated, so that each counts once).
        group: the tensor-parallel process group.
        norm_type: 2.0 or `inf`.
    """
    if norm_type not in (2.0, float("inf")):
        raise ValueError(f"norm_type={norm_type} is not supported with tensor parallelism; use 2.0 or inf")
    parameters = list(parameters)
    shard_grads, replicated_grads = [], []
    for p in parameters:
        if p.grad is not None:
            (shard_grads if id(p) in sharded else replicated_grads).append(p.grad.detach())
    # Where the reduction runs: with the parameters (NCCL needs the GPU), even on a rank with no gradients.
    device = parameters[0].device if parameters else torch.device("cpu")

    def local_norm(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        return torch.nn.utils.get_total_norm(grads, norm_type).float().to(device)

    if norm_type == 2.0:  # norms of shards combine as the root of summed squares
        shard_part = local_norm(shard_grads).square().reshape(1)
        specs = sharded if isinstance(sharded, Mapping) else {}
        world_size = dist.get_world_size(group)
        for p in parameters:  # a replicated kv head: each of its replicas adds 1/replicas of its square
            spec = specs.get(id(p))
            for start, rows, copies in replicated_rows(spec, world_size) if spec and p.grad is not None else ():
                extra = p.grad.detach().narrow(spec.dim, start, rows).float().square().sum()
                shard_part -= (1 - 1 / copies) * extra.to(device)
        dist.all_reduce(shard_part, group=group)
        return (shard_part[0] + local_norm(replicated_grads).square()).sqrt()
    shard_part = local_norm(shard_grads).reshape(1)
    dist.all_reduce(shard_part, op=dist.ReduceOp.MAX, group=group)
    return torch.maximum(shard_part[0], local_norm(replicated_grads))


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    sharded: Collection[int] | Mapping[int, ShardSpec],
    group: ProcessGroup,
    norm_type: float = 2.0,
) -> torch.Tensor:
    """Scales gradients in place so their global norm is at most `max_norm`; returns the norm before clipping."""
    parameters = list(parameters)
    total = global_grad_norm(parameters, sharded, group, norm_type)
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
