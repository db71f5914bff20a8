"""`parallelize`: shard an already-built model across a tensor-parallel group, in place."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tp_train.checkpoint.pretrained import load_pretrained_modules
from tp_train.parallel.collectives import CommunicationCounter
from tp_train.parallel.layers import Configurable
from tp_train.parallel.mesh import as_process_group
from tp_train.parallel.random import TensorParallelRNG, may_draw_dropout
from tp_train.plan.activation_checkpointing import checkpoint_blocks
from tp_train.plan.apply import apply_plan
from tp_train.plan.autoplan import COMPLETED_SOURCE, INFERRED_SOURCE, format_plan
from tp_train.plan.caches import caches_kept
from tp_train.plan.context_parallel import enable_context_parallel
from tp_train.plan.layout import block_layout
from tp_train.plan.match import match_plan
from tp_train.plan.region_check import RegionCheck
from tp_train.plan.resolve import SKIPPED, resolve_plan
from tp_train.plan.sequence_parallel import apply_sequence_parallel, check_sequence_parallel
from tp_train.plan.styles import PlannedModule, adapted_model, linear_shape
from tp_train.plan.verify import SwapCheck, unsharded_reference, unsharded_skeleton, verify_parallelized

# Up to this many bytes of parameters, default verification also checks the whole model: a full copy, its
# gradients and a probe's activations per rank, a few times the model's size for a moment.
WHOLE_MODEL_CHECK_BYTES = 32 * 2**20


def _default_device(model: nn.Module) -> torch.device:
    real = [p.device for p in model.parameters() if not p.is_meta]
    if real:
        return real[0]
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def parallelize(
    model: nn.Module,
    tp_group: ProcessGroup | DeviceMesh | None = None,
    plan: dict[str, str] | None = None,
    loss_parallel: bool = False,
    device: torch.device | str | None = None,
    verify: bool | None = None,
    weights: str | Path | None = None,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    compile: bool = False,
    overlap: bool | None = None,
    example_input=None,
    cp_group: ProcessGroup | None = None,
    cp_options: dict | None = None,
) -> nn.Module:
    """Shards `model` in place across `tp_group` and returns it; it then computes the same function.

    Every rank must call this with the same model (same weights) and plan. Each planned module is replaced by
    its tensor-parallel counterpart holding this rank's slice of the existing weights (see `tp_train.plan.apply` for
    the styles). The plan is, in order: `plan`, `model.tp_plan`, the Hugging Face model's `base_model_tp_plan`,
    a built-in preset, else the auto-planner's (`tp_train.plan.autoplan`; printed on rank 0). A pattern that matches
    nothing, or a dimension tp does not divide, raises `ValueError` before any weight changes.
    `model.tp_comm_counter` (a `CommunicationCounter`) then counts the bytes its tensor-parallel collectives move.

    Args:
        model: the unsharded model, on the device it will run on.
        tp_group: a ProcessGroup, a 1-D DeviceMesh, or None for the whole world.
        plan: {module-name pattern: style}; `*` matches one name component.
        loss_parallel: keep the `colwise_gather_output` head sharded along the vocabulary, for
            `vocab_parallel_cross_entropy`: no rank then holds full logits. `model.tp_vocab_size` records the
            head's real vocabulary size, which that loss needs. By default the head gathers, and the model returns
            full logits.
        device: where to materialise a model built on the meta device (each rank allocates only its shards, and
            the initial weights are the same at every tp for the same seed). Default: the current CUDA device,
            else CPU.
        verify: check the sharding and raise `PlanVerificationError` on a difference (`tp_train.plan.verify`): each
            swapped module against the module it replaced (one module's tensors at a time), each module a region
            style wraps (MoE experts, `all_reduce`) against itself before sharding on its probe arguments, then the
            whole sharded model against the unsharded one on a probe batch, outputs and gradients (a full copy per
            rank while it runs). Default None: both for every plan, the whole-model check only for models of at most
            `WHOLE_MODEL_CHECK_BYTES` of parameters; True: both always; False: neither. Rank 0 prints one line
            saying what was checked and the largest difference.
        weights: pretrained safetensors weights (a file, or a `save_pretrained` directory) to fill the sharded
            model from, each rank reading only its slices (`tp_train.load_pretrained`). Default: submodules that
            record a `pretrained_weights` path (a `model=hf model.path=...` built on meta) are filled from it.
        sequence_parallel: shard the residual stream between the blocks along the sequence (norms, dropout and
            residual adds on 1/tp of the tokens; each sub-block's all-reduce becomes all-gather + reduce-scatter).
            Needs the blocks in one nn.ModuleList and a `colwise_gather_output` head; the sequence length must be
            a multiple of tp. See `tp_train.plan.sequence_parallel`.
        activation_checkpointing: recompute each block's forward in backward instead of keeping its activations
            (dropout replays the same masks). See `tp_train.plan.activation_checkpointing`.
        compile: compile the sharded model in place (`nn.Module.compile`, torch's default inductor backend) once
            it is sharded and verified. Its collectives trace as torch's functional collectives, so a model without
            dropout compiles with no graph break; with dropout, each switch of random stream breaks the graph
            (`tp_train.parallel.random`). The tensor-parallel traffic of compiled steps is not counted.
        overlap: in backward, start each column-parallel entry's collective (the all-reduce of `f`, or sequence
            parallelism's reduce-scatter) asynchronously and compute the weight gradients while it runs
            (`tp_train.parallel.overlap`): the same collectives, the same results. Eager only (compiled models
            use functional collectives). False: the plain path, e.g. to measure what overlap saves. Default None:
            on with NCCL, which runs collectives beside the compute, off with gloo, whose collectives take the CPU
            cores the compute needs (slower in the benchmark's CPU runs).
        example_input: what the model's forward takes, for the auto-planner's probe, verification and the region
            check: a tensor (its one positional argument), a tuple (positional arguments) or a dict (keyword
            arguments), the same on every rank; a batch or two of real inputs is plenty. Default: a Hugging Face
            model's config-shaped batch (its `main_input_name`; pixel values, audio features, decoder token ids as
            its config says), else random token ids (`tp_train.plan.probe_input`).
        cp_group: a context-parallel group: each of its ranks then runs the model on its share of every sequence
            and attention spans the group (`tp_train.plan.context_parallel`, after tensor-parallel sharding and its
            verification). `cp_options`: `enable_context_parallel`'s keyword arguments (rotation,
            document_separator).
    """
    wrapped = adapted_model(model)
    if wrapped is not None:  # a peft wrapper: its model is planned in the names its own plan uses
        settings = dict(plan=plan, loss_parallel=loss_parallel, device=device, verify=verify, weights=weights,
                        sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                        compile=compile, overlap=overlap, example_input=example_input, cp_group=cp_group,
                        cp_options=cp_options)  # fmt: skip
        parallelize(wrapped[1], tp_group, **settings)
        return model
    group = as_process_group(tp_group)
    resolved, source = resolve_plan(model, plan, dist.get_world_size(group), example_input)
    if source.endswith((INFERRED_SOURCE, COMPLETED_SOURCE)) and dist.get_rank() == 0:
        print(format_plan(resolved, source), flush=True)
    elif SKIPPED in source and dist.get_rank() == 0:
        print(f"tensor-parallel plan: {source}", flush=True)
    planned = match_plan(model, resolved, dist.get_world_size(group), example_input)
    vocab_size = _head_vocab_size(planned, source) if loss_parallel else None
    whole_model = verify or (verify is None and _parameter_bytes(model) <= WHOLE_MODEL_CHECK_BYTES)
    skeleton = unsharded_skeleton(model) if whole_model else None  # on the meta device: no memory
    check = SwapCheck(group) if verify is not False else None
    regions = RegionCheck(group, planned) if verify is not False else None
    layout = None
    if sequence_parallel or activation_checkpointing:
        feature = "sequence_parallel" if sequence_parallel else "activation_checkpointing"
        layout = block_layout(model, planned, feature)
        if sequence_parallel:
            check_sequence_parallel(model, layout)
    blocks = layout.blocks if layout is not None else _blocks_if_any(model, planned)
    device = torch.device(device) if device is not None else _default_device(model)
    # Also syncs the default generator, so every rank inits alike.
    rng = TensorParallelRNG(group, device, dropout=may_draw_dropout(model))
    if regions is not None:  # the unsharded region modules' arguments and results, before any weight changes
        regions.record(model, example_input)
    apply_plan(model, planned, group, rng, device, loss_parallel=loss_parallel, check=check)
    if check is not None:
        check.raise_on_difference()
        regions.check(model)  # before pretrained weights replace those its references were computed with
    load_pretrained_modules(model, group, weights)
    counter = CommunicationCounter()
    if sequence_parallel:
        apply_sequence_parallel(model, layout, group, rng, counter)
    if activation_checkpointing:
        checkpoint_blocks(model, layout, rng)
    model.tp_rng = rng
    model.tp_blocks = blocks  # the transformer blocks' names, for per-block wrapping (`fully_shard_data_parallel`)
    if vocab_size is not None:
        model.tp_vocab_size = vocab_size
    whole_model_errors = None
    if skeleton is not None:
        reference = unsharded_reference(skeleton, model, group)
        with caches_kept(model):  # its probe forward's, from the gradient-tracking pass it backpropagates
            whole_model_errors = verify_parallelized(model, reference, group, planned, example_input)
    if check is not None and dist.get_rank() == 0:
        print(_verification_summary(check, regions, whole_model_errors), flush=True)
    model.tp_comm_counter = _count_communication(model, counter)
    _configure_overlap(model, dist.get_backend(group) == "nccl" if overlap is None else overlap)
    counter.reset()  # verification's traffic is not training's
    if cp_group is not None:
        enable_context_parallel(model, cp_group, **(cp_options or {}))
    if compile:
        model.compile()
    return model


def _blocks_if_any(model: nn.Module, planned: list) -> list[str]:
    """The transformer blocks' names, or none when the plan's layers are not in one ModuleList."""
    try:
        return block_layout(model, planned, "per-block wrapping").blocks
    except ValueError:
        return []


def _head_vocab_size(planned: list[PlannedModule], source: str) -> int:
    """The real vocabulary size of the one head whose logits `loss_parallel` keeps sharded."""
    heads = {entry.name: linear_shape(entry.module)[1] for entry in planned if entry.style == "colwise_gather_output"}
    if len(set(heads.values())) != 1:
        found = ", ".join(f"'{name}' ({size})" for name, size in heads.items()) or "none"
        raise ValueError(
            f"loss_parallel=True needs one vocabulary size among the heads planned 'colwise_gather_output' by "
            f"{source}; found {found} (plan the LM head 'colwise_gather_output', or pass loss_parallel=False)"
        )
    return next(iter(heads.values()))


def _parameter_bytes(model: nn.Module) -> int:
    return sum(param.numel() * param.element_size() for param in model.parameters())


def _verification_summary(check: SwapCheck, regions: RegionCheck, whole_model: dict[str, float] | None) -> str:
    """One line: what verification checked and the largest relative difference it saw."""
    worst = max(check.errors.values(), default=0.0)
    text = f"tensor-parallel plan verified: {len(check.errors)} swapped modules against the modules they replaced"
    text += f" (largest relative difference {worst:.1e})"
    if check.skipped:
        text += f", {len(check.skipped)} through the module they are tied to"
    if regions.errors:
        worst = max(regions.errors.values())
        text += f", {len(regions.errors)} region modules against themselves unsharded ({worst:.1e})"
    elif regions.entries and regions.skipped:
        text += f", region modules not checked ({regions.skipped})"
    if whole_model is None:
        return text + "; whole-model check skipped (model above the size for a full copy; verify=True forces it)"
    return text + (
        f", and the whole model on a probe batch (outputs {whole_model.get('output', 0.0):.1e}, "
        f"gradients {whole_model.get('gradient', 0.0):.1e})"
    )


def _count_communication(model: nn.Module, counter: CommunicationCounter) -> CommunicationCounter:
    """`counter` for every parallel layer of `model` (and their shared input regions)."""
    for module in model.modules():
        if isinstance(module, Configurable):
            module.configure(comm_counter=counter)
        for attribute in ("input_region", "tp_region"):  # shared input regions; a region style's collectives
            region = getattr(module, attribute, None)
            if region is not None:
                region.configure(comm_counter=counter)
    return counter


def _configure_overlap(model: nn.Module, overlap: bool) -> None:
    """Switches backward overlap on or off in every column layer of `model` and the regions its layers enter by."""
    for module in model.modules():
        for configurable in (module, getattr(module, "input_region", None)):
            if isinstance(configurable, Configurable) and "overlap" in configurable.SETTINGS:
                configurable.configure(overlap=overlap)


def attached(root: nn.Module, attribute: str) -> list:
    """What `parallelize` attached as `attribute` (`tp_rng`, `tp_comm_counter`) to the sharded models inside
    `root`, each object once."""
    found = (getattr(module, attribute, None) for module in root.modules())
    return list({id(value): value for value in found if value is not None}.values())
