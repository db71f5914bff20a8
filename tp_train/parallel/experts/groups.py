"""The averaging of the experts' gradients over the ranks that hold the same experts (the expert-replica view of
`tp_train.parallel.dims.ParallelMesh`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


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
