"""`ParallelTraining`: what a training step needs from a model that `parallelize_for_training` parallelized, whichever
dimensions it applied: the module to call, the pipeline schedule (or none), `no_sync` for gradient accumulation, the
work after backward, the groups the clipping norm reduces over, and the whole model's size. A Lightning strategy and a
plain PyTorch loop drive training through the same object."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from tp_train.parallel.clipping import clip_grad_norm_, clip_grads_with_norm_, global_grad_norm
from tp_train.parallel.context_parallel.models import mean_over_group
from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.parallel.experts import named_expert_parameters
from tp_train.parallel.invariant import FAST
from tp_train.parallel.pipeline import Pipeline
from tp_train.parallel.pipeline.runner import average_gradients
from tp_train.parallel.sharding import ShardSpec, full_numel, named_sharded_parameters
from tp_train.training.experts import TrainingExperts


@dataclass(frozen=True)
class ClippingGroups:
    """What a gradient norm over the whole model needs on this rank: `tp_train.clip_grad_norm_`'s arguments."""

    tensor_parallel: ProcessGroup
    sharded_parameters: Mapping[int, ShardSpec]  # id(shard) -> how it is split over the tensor-parallel ranks
    pipeline_parallel: ProcessGroup | None = None  # with pipeline stages: the norm sums over them
    pipeline_duplicates: frozenset[int] = frozenset()  # id() of tied copies an earlier stage holds (counted once)
    experts: tuple[frozenset[int], ProcessGroup] | None = None  # (id() of this rank's experts, the ep group)
    numerics: str = FAST  # "invariant": the norm in one fixed order (`tp_train.parallel.clipping`)

    def clip_(self, parameters: Iterable[nn.Parameter], max_norm: float) -> torch.Tensor:
        """Scales the gradients of `parameters` (this rank's) so that the whole model's norm is at most `max_norm`;
        returns that norm (before clipping), the same on every rank."""
        parameters = list(parameters)
        if self.pipeline_parallel is None:
            return clip_grad_norm_(
                parameters, max_norm, self.sharded_parameters, self.tensor_parallel, experts=self.experts,
                numerics=self.numerics,
            )  # fmt: skip
        # each stage's parameters are its own: this stage's norm over tp (and FSDP2's dp), its square summed over
        # the stages, each tied parameter counted on the first stage holding it
        counted = [param for param in parameters if id(param) not in self.pipeline_duplicates]
        stage = global_grad_norm(counted, self.sharded_parameters, self.tensor_parallel, experts=self.experts)
        squared = stage.square().reshape(1)
        dist.all_reduce(squared, group=self.pipeline_parallel)
        norm = squared[0].sqrt()
        clip_grads_with_norm_(parameters, max_norm, norm)
        return norm


@dataclass
class ParallelTraining:
    """One model parallelized for training over `dims` on `mesh` (see `parallelize_for_training`).

    `root` is the model as parallelized (its stages only under a pipeline); `module` is what a step calls: `root`, or
    DDP around it. Under a pipeline, `pipeline` runs each step's forward and backward (its `train_step`, or a caller's
    loss through `loss_fn`) and `module` is not called. After each backward (the last micro-batch's, when
    accumulating inside `no_sync`), call `after_backward`: the data-parallel average a pipeline leaves to it and the
    experts' average over their replicas."""

    root: nn.Module
    module: nn.Module
    dims: ParallelDims
    mesh: ParallelMesh
    experts: TrainingExperts
    pipeline: Pipeline | None = None
    loss_parallel: bool = False  # the LM head's logits stay split over the vocabulary (a vocab-parallel loss)
    # the pipeline's stages, DDP's way: their gradients averaged over the replicas in `after_backward`
    pipeline_replicas: ProcessGroup | None = None
    numerics: str = FAST  # the training's `TrainingOptions.numerics`
    _synchronize: bool = field(default=True, repr=False)
    _summed_in_leaves: bool = field(default=False, repr=False)  # the last backward ran through `backward_in_leaves`

    def backward_in_leaves(self, inputs: torch.Tensor, loss_of) -> torch.Tensor:
        """`numerics="invariant"`'s backward of a batch (`tp_train.training.leaves.backward_in_leaves`): `inputs`
        this rank's consecutive share of the global batch's samples, `loss_of(samples)` their mean loss, run through
        `module`; the gradients summed over the data-parallel replicas in a fixed order; returns the batch's loss."""
        from tp_train.training.leaves import backward_in_leaves

        self._summed_in_leaves = True
        return backward_in_leaves(list(self.root.parameters()), inputs, loss_of, self.mesh.replicas.get_group())

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulating micro-batches: no data-parallel gradient reduction inside (DDP's `no_sync`, FSDP2's
        `set_requires_gradient_sync(False)`, a pipeline's and the experts' averages in `after_backward` skipped);
        the backward after it reduces the sum."""
        self._synchronize = False
        try:
            with ExitStack() as stack:
                stack.enter_context(self.experts.blocking())
                if isinstance(self.module, DistributedDataParallel):
                    stack.enter_context(self.module.no_sync())
                if isinstance(self.root, FSDPModule):
                    self.root.set_requires_gradient_sync(False)
                    stack.callback(self.root.set_requires_gradient_sync, True)
                yield
        finally:
            self._synchronize = True

    def after_backward(self) -> None:
        """Outside `no_sync`: the pipeline stages' gradients averaged over their data x context parallel replicas
        (DDP's all-reduce; FSDP2's stages reduce-scatter their own), and the experts' over the ranks holding them."""
        if not self._synchronize:
            return
        if self.numerics != FAST and self.dims.dp_cp > 1 and not self._summed_in_leaves:
            raise RuntimeError(
                "numerics='invariant' at dp > 1 sums the gradients over the replicas in ParallelTraining."
                "backward_in_leaves; a plain backward leaves each rank its own share's"
            )
        self._summed_in_leaves = False
        if self.pipeline is not None and self.pipeline_replicas is not None:
            held = {id(param) for param in self.experts.held}
            dense = [param for param in self.pipeline.parameters() if id(param) not in held]
            average_gradients(dense, self.pipeline_replicas)
        self.experts.after_backward()

    def batch_loss(self, loss: torch.Tensor, weight: torch.Tensor | float = 1.0) -> torch.Tensor:
        """For logging: the whole batch's loss, as one process would compute it, from this rank's `loss` (its share's
        mean, over `weight` targets; 1 where it is not a token mean): the weighted mean over the data x context
        parallel ranks (`mesh.replicas`: other tokens, the same parameters), detached; one all-reduce of two numbers.
        A rank whose targets were all ignored adds nothing; a batch with none counted gives 0. Under a pipeline, call
        it with the pipeline's batch loss (the same on every stage). The gradients are not touched."""
        group = self.mesh.replicas.get_group()
        if dist.get_world_size(group) == 1:
            return loss
        count = torch.as_tensor(weight, dtype=torch.float32, device=loss.device)
        return mean_over_group(loss.detach(), count, group).detach()

    def clipping(self) -> ClippingGroups:
        """The clipping norm's groups and the tensor-parallel shards, by `id()` of the parameters as they are now
        (FSDP2 replaces them)."""
        pipeline = self.pipeline
        return ClippingGroups(
            tensor_parallel=self.mesh.tensor_parallel.get_group(),
            sharded_parameters={id(param): spec for _, param, spec in named_sharded_parameters(self.root)},
            pipeline_parallel=None if pipeline is None else self.mesh.pipeline_parallel.get_group(),
            pipeline_duplicates=frozenset() if pipeline is None else pipeline.duplicate_parameters(),
            experts=self.experts.clipping(),
            numerics=self.numerics,
        )

    def parameter_counts(self, device: torch.device) -> tuple[int, int]:
        """The whole model's parameters and its trainable ones, as one process holds them (`count_parameters`): every
        pipeline stage's, summed over the pipeline's ranks (on `device`; every rank calls), a tied parameter counted
        once, on the first stage holding it."""
        if self.pipeline is None:
            return count_parameters(self.root)
        counts = count_parameters(self.root, self.pipeline.duplicate_parameters())
        total = torch.tensor(counts, dtype=torch.int64, device=device)
        dist.all_reduce(total, group=self.mesh.pipeline_parallel.get_group())
        parameters, trainable = total.tolist()
        return parameters, trainable


def count_parameters(root: nn.Module, duplicates: frozenset[int] = frozenset()) -> tuple[int, int]:
    """The parameters of `root` on this rank and its trainable ones, each counted whole: a tensor-parallel shard as
    its full tensor, this rank's run of experts as all of them (FSDP2's parameters are whole over the data-parallel
    ranks already); those in `duplicates` (by `id()`) not counted."""
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(root)}
    full = {id(p): full_numel(p, specs[id(p)]) if id(p) in specs else p.numel() for p in root.parameters()}
    for _, param, region in named_expert_parameters(root):
        full[id(param)] = param.numel() // region.local * region.num_experts
    counted = [param for param in root.parameters() if id(param) not in duplicates]
    return sum(full[id(p)] for p in counted), sum(full[id(p)] for p in counted if p.requires_grad)
