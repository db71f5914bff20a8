"""Expert parallelism in training (`tp_train.training.parallelize_for_training`): the experts split over the data x
context parallel ranks, the dense parameters left to DDP (or FSDP2), the experts' gradients averaged over exactly the
ranks holding them. Under FSDP2 the experts stay out of it (`held`, its ignored parameters): whole on each rank of
their expert-parallel run, replicated over their expert replicas, averaged over those as under DDP.

    replicas (dp x cp = 4), ep = 2:   rank  0  1 | 2  3      experts 0-3 on ranks 0, 2; experts 4-7 on ranks 1, 3
    expert-parallel groups (tokens travel within):   {0, 1} {2, 3}
    expert replicas (experts' gradients averaged):   {0, 2} {1, 3}
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from tp_train.parallel.dims import ParallelMesh
from tp_train.parallel.experts import (
    ExpertParallelRegion,
    average_expert_gradients,
    named_expert_parameters,
    shard_experts,
)
from tp_train.parallel.pipeline.split import skipped
from tp_train.parallel.sharding import named_sharded_parameters
from tp_train.plan.deciding.experts import find_experts
from tp_train.plan.gradient_hooks import keep_gradient_hooks


def check_expert_parallel(model: nn.Module, expert_parallel_size: int) -> dict[str, int]:
    """`find_experts(model)`, once `expert_parallel_size` is known to fit every experts module: raises ValueError
    (one line naming the model, the size and what would work) for no experts found, or a size above or not dividing
    a layer's number of experts."""
    found = find_experts(model)
    if expert_parallel_size == 1:
        return found
    if not found:
        raise ValueError(
            f"expert_parallel_size={expert_parallel_size} but {type(model).__name__} has no experts module (a module "
            f"with num_experts and its experts' weights stacked as (num_experts, ...) tensors); use ep=1"
        )
    for name, experts in found.items():
        if expert_parallel_size > experts or experts % expert_parallel_size:
            fits = [size for size in range(1, experts + 1) if experts % size == 0]
            raise ValueError(
                f"expert_parallel_size={expert_parallel_size} does not divide the {experts} experts of '{name}' "
                f"({type(model).__name__}); use one of {fits}"
            )
    return found


def check_expert_parallel_arguments(expert_parallel_size: int, capacity_factor: float | None = None) -> None:
    """Raises ValueError for a size that is not a positive integer, or a capacity factor that is not a positive
    number (or one without expert parallelism, whose dispatch applies it). Every composition (tp with sequence
    parallelism, pp, FSDP2, consolidated checkpoints) runs."""
    if not isinstance(expert_parallel_size, int) or isinstance(expert_parallel_size, bool) or expert_parallel_size < 1:
        raise ValueError(f"expert_parallel_size={expert_parallel_size!r} must be a positive integer")
    if capacity_factor is not None:
        if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, int | float) or capacity_factor <= 0:
            raise ValueError(
                f"expert_capacity_factor={capacity_factor!r} must be a positive number (e.g. 1.25), or None: dropless"
            )
        if expert_parallel_size == 1:
            raise ValueError(
                f"expert_capacity_factor={capacity_factor} caps the tokens the expert-parallel dispatch sends each "
                f"expert, which expert_parallel_size=1 does not run; use expert_parallel_size > 1, or None"
            )


class TrainingExperts:
    """What training does for expert parallelism at `size` ranks per expert-parallel group (1: nothing);
    `capacity_factor` (None: dropless) is checked with it (`check_expert_parallel_arguments`)."""

    def __init__(self, size: int, capacity_factor: float | None = None) -> None:
        check_expert_parallel_arguments(size, capacity_factor)
        self.size, self.capacity_factor = size, capacity_factor
        self._replicas: Any = None  # the data x context parallel group: drops are summed over it
        self.mesh: ParallelMesh | None = None  # its expert views exist at size > 1
        self._parameters: list[nn.Parameter] = []
        self._blocked = False  # inside `blocking` (gradient accumulation)

    def setup_groups(self, mesh: ParallelMesh) -> None:
        """The expert-parallel and expert-replica views of the job's mesh (`ParallelDims.build_mesh`)."""
        if self.size > 1:
            self.mesh = mesh
            self._replicas = mesh.replicas.get_group()

    def shard(self, root: nn.Module, tensor_parallel_size: int, skip: Collection[str] = ()) -> None:
        """Splits `root`'s experts over the expert-parallel group and keeps them out of DDP's all-reduce (before
        DDP wraps `root`; its broadcast from rank 0 would otherwise overwrite each rank's own experts). The modules
        in `skip` (another pipeline stage's, still on the meta device) are left alone."""
        if self.mesh is None:
            return
        # At tp=1 a plan's split of the experts (moe_tp_experts) is whole: only a real split is refused.
        split = {id(param) for _, param, _ in named_sharded_parameters(root)} if tensor_parallel_size > 1 else set()
        names = [name for name in check_expert_parallel(root, self.size) if not skipped(name, skip)]
        for name in names:
            if any(id(param) in split for param in root.get_submodule(name).parameters()):
                raise ValueError(
                    f"expert_parallel_size={self.size}: the tensor-parallel plan splits the experts of '{name}' "
                    f"across the tensor-parallel ranks (moe_tp_experts), which does not compose with expert "
                    f"parallelism yet; use tensor_parallel_size=1, or a plan that leaves the experts whole"
                )
        # Each expert's gradient scaled by 1/ep: averaged over its replicas, it is the mean over every replica's
        # tokens (DDP's convention for the dense ones).
        shard_experts(root, names, self.mesh.expert_parallel.get_group(), 1 / self.size, self.capacity_factor)
        for name in names:
            # Under sequence parallelism each tensor-parallel rank's experts see its own sequence shard's tokens: the
            # plan's sum of their gradients over the tensor-parallel group goes onto the sliced parameters too.
            keep_gradient_hooks(root.get_submodule(name))
        named = named_expert_parameters(root)
        self._parameters = [param for _, param, _ in named]
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(root, [name for name, _, _ in named])

    @property
    def held(self) -> set[nn.Parameter]:
        """This rank's expert parameters (empty at ep=1): what DDP and FSDP2 leave alone."""
        return set(self._parameters)

    def clipping(self) -> tuple[frozenset[int], Any] | None:
        """What the precision plugin's norm needs: the experts' ids and the group holding the other experts."""
        if self.mesh is None:
            return None
        return frozenset(id(param) for param in self._parameters), self.mesh.expert_parallel.get_group()

    def after_backward(self) -> None:
        """The experts' gradients averaged over their replicas, once per optimizer step (the last micro-batch)."""
        if self.mesh is not None and not self._blocked:
            average_expert_gradients(self._parameters, self.mesh.expert_replicas.get_group())

    @contextmanager
    def counting_drops(self, root: nn.Module, log: Callable[[str, float], Any], device: torch.device):
        """Around a training step's forward (a recompute in its backward is not counted): with a capacity factor,
        passes to `log` the (token, expert) assignments each MoE layer of `root` dropped over capacity in the whole
        batch, as `train/moe/dropped_<layer>` (summed over the data x context parallel ranks)."""
        regions = [] if self.capacity_factor is None else self._regions(root)
        for region in regions:
            region.dropped = 0
        yield
        if regions:
            # float64, not the default dtype: bf16 in a bf16-true step, where a count above 256 would be rounded
            counts = torch.tensor([float(region.dropped) for region in regions], device=device, dtype=torch.float64)
            dist.all_reduce(counts, group=self._replicas)
            for layer, count in enumerate(counts.tolist()):
                log(f"train/moe/dropped_{layer}", count)

    @staticmethod
    def _regions(root: nn.Module) -> list[ExpertParallelRegion]:
        regions = {id(region): region for _, _, region in named_expert_parameters(root)}
        return list(regions.values())

    @contextmanager
    def blocking(self):
        """While Lightning accumulates micro-batches: their sum is averaged after the last one."""
        self._blocked = True
        try:
            yield
        finally:
            self._blocked = False
