"""Expert parallelism: each rank of an expert-parallel group holds a run of every MoE layer's experts, and tokens
travel to their experts' ranks and back by all-to-all (`dispatch`, `combine`). Knows nothing of Lightning or plans:
`shard_experts` takes the experts modules' names."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.experts.dispatch import all_to_all, combine, dispatch, expert_capacity
from tp_train.parallel.experts.groups import average_expert_gradients
from tp_train.parallel.experts.region import ExpertParallelRegion, named_expert_parameters

__all__ = [
    "ExpertParallelRegion",
    "all_to_all",
    "average_expert_gradients",
    "combine",
    "dispatch",
    "expert_capacity",
    "named_expert_parameters",
    "shard_experts",
]


def shard_experts(
    model: nn.Module,
    names: Iterable[str],
    group: ProcessGroup,
    gradient_scale: float = 1.0,
    capacity_factor: float | None = None,
) -> None:
    """Runs each experts module `names` of `model` expert-parallel over `group` (`ExpertParallelRegion`, with its
    `gradient_scale` and `capacity_factor`), in place: each rank keeps its run of the experts under the parameters'
    own names."""
    for name in names:
        module = model.get_submodule(name)
        experts = getattr(module, "num_experts", None)
        if experts is None:
            raise ValueError(f"module '{name}' ({type(module).__name__}) has no num_experts: is it an experts module?")
        ExpertParallelRegion(group, experts, gradient_scale, capacity_factor).install(module)
