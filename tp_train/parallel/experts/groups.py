"""The process groups of expert parallelism, a view over the data x context parallel ranks (the replicas), and the
averaging of the experts' gradients over the ranks that hold the same experts."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tp_train.parallel.mesh import EXPERT_PARALLEL, EXPERT_REPLICAS


@dataclass(frozen=True)
class ExpertGroups:
    """`mesh` (expert_data_parallel, expert_parallel): the replicas regrouped. Along `expert_parallel`, runs of
    consecutive replicas that split the experts between them (tokens travel among them); along
    `expert_data_parallel`, the ranks holding the same run of experts, over which its gradients are averaged."""

    mesh: DeviceMesh

    @property
    def expert_parallel(self) -> ProcessGroup:
        return self.mesh[EXPERT_PARALLEL].get_group()

    @property
    def expert_replicas(self) -> ProcessGroup:
        return self.mesh[EXPERT_REPLICAS].get_group()


def expert_groups(replicas: DeviceMesh, expert_parallel_size: int, backend_override: Any = None) -> ExpertGroups:
    """Regroups `replicas` (the 1-D data x context parallel mesh, context innermost) into runs of
    `expert_parallel_size` consecutive ranks (a collective over the world: every rank builds every group)."""
    size = replicas.size()
    if size % expert_parallel_size:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} does not divide the {size} data x context parallel ranks; "
            f"use one of {[ep for ep in range(1, size + 1) if size % ep == 0]}"
        )
    names = (EXPERT_REPLICAS, EXPERT_PARALLEL)
    override = None if backend_override is None else dict.fromkeys(names, backend_override)
    mesh = replicas._unflatten(0, (size // expert_parallel_size, expert_parallel_size), names, override)
    return ExpertGroups(mesh)


def average_expert_gradients(parameters: Iterable[torch.Tensor], group: ProcessGroup) -> None:
    """Averages the gradients of `parameters` (this rank's experts) over `group`, the ranks holding the same
    experts: one flat all-reduce. With the dispatch's 1/ep scale (`ExpertParallelRegion`), each expert's gradient is
    then the mean over every data x context rank's tokens, as DDP makes the dense gradients."""
    grads = [param.grad for param in parameters if param.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return
    flat = torch.cat([grad.reshape(-1) for grad in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
        offset += grad.numel()
