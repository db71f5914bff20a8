"""`parallelize_for_training`: every parallel dimension applied to one model for training, in one order, with no
Lightning in it (`TensorParallelStrategy` is glue around it; a plain PyTorch loop calls it the same way).

The order, on every rank:
1. Decide where the pipeline splits, on the model as written (`plan_pipeline_split`).
2. Per planned model: tensor (and sequence) parallelism, context parallelism, activation checkpointing and compile
   (`tp_train.parallelize`, which also verifies the plan); what else was built on the meta device given storage;
   dropout streams separated per data-parallel replica; the experts split over the expert-parallel ranks.
3. Cut this rank's pipeline stages (`tp_train.Pipeline`, the model cut in place), FSDP2 on each stage's blocks.
4. The parameters' dtype (`convert`) and device.
5. Data parallelism over the data x context parallel ranks: FSDP2 (or HSDP) per block, model and root; or DDP
   (`wrap_replicas`); a pipeline averages its stages' gradients itself (`ParallelTraining.after_backward`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.utils import _sync_module_states
from torch.nn.parallel import DistributedDataParallel

from tp_train.parallel import invariant
from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.parallel.fake_ranks import fake_group
from tp_train.parallel.invariant import FAST
from tp_train.parallel.pipeline import Pipeline, schedule_named
from tp_train.parallel.pipeline.runner import stage_indices
from tp_train.parallel.pipeline.split import PipelineSplit, skipped, within
from tp_train.parallel.random import sync_default_generator
from tp_train.plan.deciding.resolve import modules_with_plans
from tp_train.plan.meta_init import materialize_remaining
from tp_train.plan.parallelize import attached, parallelize
from tp_train.plan.probe_input import ProbeInput
from tp_train.training.data_parallel import fully_shard_data_parallel, refuse_replicated_shards
from tp_train.training.experts import TrainingExperts
from tp_train.training.parallel_training import ParallelTraining
from tp_train.training.pipeline_split import count_blocks, find_blocks, plan_pipeline_split

BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's bucket for the first broadcast of the weights
TRAINING_ATTRIBUTE = "_tp_training"  # on the root: what `parallelize_for_training` made of it, applied once


@dataclass(frozen=True)
class TrainingOptions:
    """How each dimension is applied (its degree is `ParallelDims`'); the arguments of `TensorParallelStrategy` with
    the same names say what each does."""

    plan: dict[str, str] | None = None  # an explicit plan for the whole root; None: each submodule's own plan
    verify_plan: bool | None = None
    loss_parallel: bool = False
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    compile: bool = False
    overlap: bool | None = None
    data_parallel: str = "ddp"  # or "fsdp" (HSDP with `ParallelDims.dp_shard` < dp)
    context_parallel_rotation: str = "ring"
    document_separator: int | None = None  # attention kept within documents (`document_mask`), this token between
    pipeline_schedule: str = "1f1b"
    pipeline_microbatches: int | None = None  # default: the pipeline's size
    pipeline_split: Sequence[int] | None = None  # blocks per stage; default balanced by parameters
    expert_capacity_factor: float | None = None
    fsdp_methods: tuple[str, ...] = ()  # the root's methods that gather its parameters like `forward` (FSDP2)
    numerics: str = FAST  # or "invariant": the same bits at every layout (`tp_train.parallel.invariant`)


def check_invariant_dims(dims: ParallelDims, numerics: str, data_parallel: str = "ddp") -> None:
    """What `numerics="invariant"` covers so far, one line for the rest: tensor parallelism, and data parallelism
    over DDP's replicas (the backward in leaves: `ParallelTraining.backward_in_leaves`)."""
    others = [f"{name}={getattr(dims, name)}" for name in ("cp", "pp", "ep") if getattr(dims, name) > 1]
    if dims.dp > 1 and data_parallel != "ddp":
        others.insert(0, f"dp={dims.dp} with data_parallel={data_parallel}")
    if invariant.check_numerics(numerics, "numerics") == invariant.INVARIANT and others:
        raise ValueError(
            f"numerics='invariant' covers tensor parallelism and DDP's data parallelism so far, not "
            f"{', '.join(others)}; use numerics='fast' for them"
        )


def replicate(module: nn.Module, group: torch.distributed.ProcessGroup) -> DistributedDataParallel:
    """torch's DDP over `group`, on the module's device: the default `wrap_replicas`."""
    device = next(module.parameters()).device
    return DistributedDataParallel(module, device_ids=None if device.type == "cpu" else [device], process_group=group)


def parallelize_for_training(
    root: nn.Module,
    dims: ParallelDims,
    mesh: ParallelMesh,
    device: torch.device,
    options: TrainingOptions = TrainingOptions(),
    example_inputs: Callable[[list[tuple[str, nn.Module]]], dict[str, ProbeInput]] | None = None,
    convert: Callable[[nn.Module], nn.Module] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    wrap_replicas: Callable[[nn.Module, torch.distributed.ProcessGroup], nn.Module] | None = replicate,
) -> ParallelTraining:
    """Parallelizes `root` in place over `mesh` (`dims.build_mesh`) in the module docstring's order, and returns what
    training it needs (`ParallelTraining`). Called again on the same root, it applies nothing twice: only the
    data-parallel wrapper is made anew (a Lightning strategy sets up again for validation after fitting).

    Args:
        root: the model, built whole on `device` or on the meta device (`tp_train.deferred_init`). Under a pipeline,
            its one submodule with a plan (or itself) is what is cut.
        example_inputs: {name: input} for the modules to shard (given their names and modules), to plan and verify
            them on; by default each is probed on its own dummy input.
        convert: sets the parameters' dtype (a precision's `convert_module`), after sharding and cutting.
        mp_policy: FSDP2's mixed precision.
        wrap_replicas: how to wrap `root` for data parallelism over the replicas' group under DDP (default: torch's
            `DistributedDataParallel`); None with `data_parallel="ddp"` for evaluation, or a simulation (whose fake
            tensors DDP's reducer cannot take): nothing is wrapped.
    """
    training = getattr(root, TRAINING_ATTRIBUTE, None)
    if training is None:
        check_invariant_dims(dims, options.numerics, options.data_parallel)
        training = _apply(root, dims, mesh, device, options, example_inputs, convert, mp_policy)
        setattr(root, TRAINING_ATTRIBUTE, training)
    replicated = wrapped_by_ddp(training, options)
    training.module = wrap_replicas(root, mesh.replicas.get_group()) if replicated and wrap_replicas else root
    return training


def wrapped_by_ddp(training: ParallelTraining, options: TrainingOptions) -> bool:
    """Whether data parallelism wraps the model in DDP: replicas under `ddp`, outside a pipeline (which averages its
    stages' gradients itself) and outside `numerics="invariant"` (`ParallelTraining.backward_in_leaves` sums them)."""
    replicated = training.dims.dp_cp > 1 and options.data_parallel == "ddp" and training.pipeline is None
    return replicated and options.numerics == invariant.FAST


def _apply(root, dims, mesh, device, options, example_inputs, convert, mp_policy) -> ParallelTraining:
    split = None
    if dims.pp > 1:  # decided on the model as written, before the planner swaps its layers
        model = pipelined_model(root)[1]
        blocks = find_blocks(model)
        dims.check_blocks(*count_blocks(model, blocks))  # the preflight's check, for a user's own Trainer
        split = plan_pipeline_split(model, dims.stages, explicit=options.pipeline_split, blocks=blocks)
        # the head's logits gathered whole: the loss runs on the last stage's rank, which may hold no other shard
        options = replace(options, loss_parallel=False)
    experts = TrainingExperts(dims.ep, options.expert_capacity_factor)
    experts.setup_groups(mesh)
    skip = _other_stages(root, split, dims, mesh, options) if split is not None and options.verify_plan is False else ()
    loss_parallel = _shard(root, mesh, device, options, example_inputs, experts, skip)
    fsdp = options.data_parallel == "fsdp"
    pipeline = None
    if split is not None:  # this rank's stages only, FSDP2 on each of them
        policy = mp_policy

        def fully_shard_stage(stage: nn.Module) -> nn.Module:
            refuse_replicated_shards(stage, dims.tp)
            fully_shard_data_parallel(
                stage, list(stage.children()), mesh.fully_sharded, mp_policy=policy, ignored_params=experts.held
            )
            return stage

        microbatches = options.pipeline_microbatches or dims.pp
        pipeline = Pipeline(
            pipelined_model(root)[1], split, mesh.pipeline_parallel.get_group(), options.pipeline_schedule,
            microbatches, device, in_place=True, wrap=fully_shard_stage if fsdp else None,
        )  # fmt: skip
    if convert is not None:
        convert(root)
    if not fake_group():  # a simulation's fake parameters are on `device` already, and `to` cannot swap them
        root.to(device)
    if fsdp and pipeline is None and not isinstance(root, FSDPModule):
        refuse_replicated_shards(root, dims.tp)
        models = [module for _, module in modules_with_plans(root)] if options.plan is None else [root]
        fully_shard_data_parallel(
            root, models or [root], mesh.fully_sharded, mp_policy=mp_policy, extra_methods=options.fsdp_methods,
            ignored_params=experts.held,
        )  # fmt: skip
    if fsdp:  # FSDP2 frees the head's gathered weight as each forward ends, before a fused loss would read it
        for module in root.modules():
            if getattr(module, "tp_loss_fusion", None) is not None:
                module.tp_loss_fusion = None
    replicas = mesh.replicas.get_group() if pipeline is not None and not fsdp and dims.dp_cp > 1 else None
    return ParallelTraining(
        root=root, module=root, dims=dims, mesh=mesh, experts=experts, pipeline=pipeline,
        loss_parallel=loss_parallel, pipeline_replicas=replicas, numerics=options.numerics,
    )  # fmt: skip


def pipelined_model(root: nn.Module) -> tuple[str, nn.Module]:
    """The one submodule of `root` with a plan (its model), which the pipeline cuts (`root` itself where it has the
    plan); one-line error otherwise."""
    found = [(name, model) for name, model in modules_with_plans(root) if "." not in name]
    if len(found) != 1:
        names = [name for name, _ in found] or "none"
        raise ValueError(
            f"pipeline_parallel_size > 1 needs {type(root).__name__} to hold its model as one attribute with a "
            f"plan (e.g. self.model = GPT(...)); found {names}"
        )
    return found[0]


def _other_stages(
    root: nn.Module, split: PipelineSplit, dims: ParallelDims, mesh: ParallelMesh, options: TrainingOptions
) -> list[str]:
    """The modules of `root` (by name) that only other pipeline ranks' stages hold, which this rank cuts away: left
    on the meta device, never given storage (without verification, which runs the whole model)."""
    name, _ = pipelined_model(root)
    group = mesh.pipeline_parallel
    placement = schedule_named(options.pipeline_schedule, dims.virtual_stages).placement
    mine = stage_indices(split.num_stages, placement, group.get_local_rank(), group.size())
    held = {module for stage in mine for module in split.stage_modules(stage)}
    others = {module for stage in range(split.num_stages) for module in split.stage_modules(stage)} - held
    return sorted(f"{name}.{module}" if name else module for module in others)


def _shard(root, mesh, device, options, example_inputs, experts, skip) -> bool:
    """Tensor, sequence and context parallelism, checkpointing and compile on each planned model of `root`, then the
    experts, leaving the modules in `skip` on the meta device; returns whether a vocab-parallel LM head was planned
    (the loss may take its split logits)."""
    targets = [("", root)] if options.plan is not None else modules_with_plans(root)
    # No plan anywhere: the auto-planner plans the root through its forward.
    targets = targets or [("", root)]
    world = dist.group.WORLD
    if not any(t.is_meta for t in root.parameters()):
        # Ranks may have built different random weights: shard the same ones everywhere, as DDP would.
        ignored = set(getattr(root, "_ddp_params_and_buffers_to_ignore", []))
        _sync_module_states(root, world, BROADCAST_BUCKET_BYTES, src=0, params_and_buffers_to_ignore=ignored)
    else:  # built on meta: each rank draws the whole weights it keeps from rank 0's stream, as one process would,
        # though the ranks may come here on different ones (a prepare_data drew on rank 0 only)
        sync_default_generator(world, device)
    tensor_parallel = mesh.tensor_parallel.get_group()
    examples = example_inputs(targets) if example_inputs is not None else {}
    separator = options.document_separator
    cp_group = mesh.context_parallel.get_group() if mesh.context_parallel.size() > 1 or separator is not None else None
    for name, module in targets:
        parallelize(
            module, tensor_parallel, plan=options.plan, device=device, verify=options.verify_plan,
            loss_parallel="auto" if options.loss_parallel else False, compile=options.compile,
            overlap=options.overlap, sequence_parallel=options.sequence_parallel,
            activation_checkpointing=options.activation_checkpointing, example_input=examples.get(name),
            cp_group=cp_group,
            cp_options={"rotation": options.context_parallel_rotation, "document_separator": separator},
            experts_whole=experts.size > 1, skip=within(name, skip), numerics=options.numerics,
        )  # fmt: skip
    # Whatever else was built on the meta device (outside the planned models) is replicated.
    if _any_meta(root, skip):
        materialize_remaining(root, device, skip)
    data_parallel_rank = mesh.data_parallel.get_local_rank()
    for rng in attached(root, "tp_rng"):
        rng.separate_data_parallel_replicas(data_parallel_rank)
    experts.shard(root, mesh.tensor_parallel.size(), skip)  # whole experts per rank, split over the ep group
    return bool(attached(root, "tp_vocab_size"))


def _any_meta(root: nn.Module, skip) -> bool:
    """Whether a tensor of `root` outside the modules in `skip` is still on the meta device."""
    for name, module in root.named_modules():
        if not skipped(name, skip):
            tensors = [*module._parameters.values(), *module._buffers.values()]
            if any(tensor is not None and tensor.is_meta for tensor in tensors):
                return True
    return False
