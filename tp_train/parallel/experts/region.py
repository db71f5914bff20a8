"""An experts module run expert-parallel: each rank keeps its own run of the experts, and tokens travel to them.

The experts module is the model's own, unchanged: it takes (hidden (T, D), top_k_index (T, k), top_k_weights
(T, k)) and returns (T, D), the weighted sum of each token's experts (Hugging Face's `MixtralExperts` and its
kin, `models.moe.Experts`), with its experts' weights stacked along dim 0 (`num_experts` first). Installing the
region slices every such stacked parameter to this rank's experts in place (its name unchanged), and wraps each
call: before it, the tokens are dispatched and the module sees the tokens of its own experts, each routed to one
local expert with weight 1; after it, its outputs are combined back, weighted by the router's weights (so the
router's gradient flows as in the model's own sum).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.experts.dispatch import Dispatched, combine, dispatch, expert_capacity


class ExpertParallelRegion:
    """Runs `module` (an experts module holding `num_experts` stacked experts) over the expert-parallel `group`.

    Gradients: a local expert's gradient sums what every rank's tokens routed to it contribute. Where each rank's
    loss is its own tokens' mean and data-parallel gradients are averaged (DDP's convention), `gradient_scale =
    1 / group size` makes the expert's gradient that same average; 1 leaves the sum.

    `capacity_factor`: None is dropless; a number caps the tokens each expert takes from each rank per call
    (`expert_capacity`) and adds the assignments it dropped to `dropped`."""

    def __init__(
        self, group: ProcessGroup, num_experts: int, gradient_scale: float = 1.0, capacity_factor: float | None = None
    ):
        world_size = dist.get_world_size(group)
        if num_experts % world_size:
            raise ValueError(
                f"expert_parallel_size={world_size} must divide the number of experts ({num_experts}); use one of "
                f"{[size for size in range(1, num_experts + 1) if num_experts % size == 0]}"
            )
        self.group, self.num_experts, self.gradient_scale = group, num_experts, gradient_scale
        self.capacity_factor = capacity_factor
        self.dropped = 0  # assignments dropped over capacity since it was last set to 0
        self.local = num_experts // world_size
        self.first = dist.get_rank(group) * self.local  # this rank's first expert (global index)
        self.stacked: tuple[str, ...] = ()  # the module's parameters sliced to its experts (names within it)
        self._pending: list[tuple[torch.Tensor, Dispatched]] = []  # one per call in flight (nested recomputes)

    def install(self, module: nn.Module) -> None:
        """Slices `module`'s stacked expert parameters to this rank's experts and wraps its calls; the module
        keeps the region as `expert_parallel_region` (`named_expert_parameters` finds its slices by it)."""
        first = self.first
        stacked = [(name, param) for name, param in module.named_parameters() if param.shape[:1] == (self.num_experts,)]
        if not stacked:
            raise ValueError(
                f"{type(module).__name__} holds no parameter stacked over its {self.num_experts} experts (dim 0); "
                f"expert parallelism needs its experts' weights as (num_experts, ...) tensors"
            )
        for name, param in stacked:
            owner, _, leaf = name.rpartition(".")
            shard = nn.Parameter(param.detach()[first : first + self.local].clone(), param.requires_grad)
            if self.gradient_scale != 1.0:
                shard.register_hook(lambda grad: grad * self.gradient_scale)
            setattr(module.get_submodule(owner) if owner else module, leaf, shard)
        if hasattr(module, "num_experts"):
            module.num_experts = self.local
        self.stacked = tuple(name for name, _ in stacked)
        module.expert_parallel_region = self
        module.register_forward_pre_hook(self._dispatch)
        module.register_forward_hook(self._combine)

    def _dispatch(self, module, args):
        hidden, expert_index, weights = args
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(self.capacity_factor, *expert_index.shape, self.num_experts)
        rows, local_ids, _, state = dispatch(hidden, expert_index, self.num_experts, self.group, capacity)
        self.dropped += state.dropped
        self._pending.append((weights, state))
        return rows, local_ids.unsqueeze(-1), torch.ones(len(rows), 1, dtype=weights.dtype, device=weights.device)

    def _combine(self, module, args, output):
        weights, state = self._pending.pop()
        return combine(output, weights, state, self.group)


def named_expert_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter, ExpertParallelRegion]]:
    """(name, parameter, region) of every parameter of `model` that holds this rank's run of experts, each once."""
    found, seen = [], set()
    for module_name, module in model.named_modules():
        region = getattr(module, "expert_parallel_region", None)
        for name in region.stacked if region is not None else ():
            param = module.get_parameter(name)
            if id(param) not in seen:
                seen.add(id(param))
                found.append((f"{module_name}.{name}" if module_name else name, param, region))
    return found
