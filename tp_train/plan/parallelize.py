"""`parallelize`: shard an already-built model across a tensor-parallel group, in place."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tp_train.checkpoint.pretrained import load_pretrained_modules
from tp_train.parallel import invariant
from tp_train.parallel.activation_checkpointing import checkpoint_blocks
from tp_train.parallel.agreement import failures_agreed
from tp_train.parallel.collectives import CommunicationCounter
from tp_train.parallel.context_parallel.models import enable_context_parallel
from tp_train.parallel.fused_cross_entropy import HeadLossFusion
from tp_train.parallel.layers import (
    REPLICATED_INPUT,
    ColumnParallelLinear,
    Configurable,
    RowParallelLinear,
    SharedInputRegion,
    VocabParallelEmbedding,
)
from tp_train.parallel.mesh import as_process_group, first_rank_decides
from tp_train.parallel.random import TensorParallelRNG, may_draw_dropout
from tp_train.plan.applying.apply import apply_plan
from tp_train.plan.applying.sequence_parallel import apply_sequence_parallel, check_sequence_parallel
from tp_train.plan.checking.region_check import RegionCheck
from tp_train.plan.checking.verify import SwapCheck, unsharded_reference, unsharded_skeleton, verify_parallelized
from tp_train.plan.deciding.autoplan import COMPLETED_SOURCE, INFERRED_SOURCE, format_plan
from tp_train.plan.deciding.isolation import planning_isolated
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import EXPERTS_KEPT_WHOLE, SKIPPED, resolve_plan
from tp_train.plan.layout import block_layout, blocks_if_any
from tp_train.plan.probe import caches_kept
from tp_train.plan.styles import PlannedModule, adapted_model, linear_shape

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
    loss_parallel: bool | str = False,
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
    experts_whole: bool = False,
    skip: Collection[str] = (),
    numerics: str = invariant.FAST,
) -> nn.Module:
    """Shards `model` in place across `tp_group` and returns it; it then computes the same function.

    The arguments are described in docs/own-models.md ("Without Lightning")."""
    wrapped = adapted_model(model)
    if wrapped is not None:  # a peft wrapper: its model is planned in the names its own plan uses
        settings = dict(plan=plan, loss_parallel=loss_parallel, device=device, verify=verify, weights=weights,
                        sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing,
                        compile=compile, overlap=overlap, example_input=example_input, cp_group=cp_group,
                        cp_options=cp_options, experts_whole=experts_whole, skip=skip,
                        numerics=numerics)  # fmt: skip
        parallelize(wrapped[1], tp_group, **settings)
        return model
    group = as_process_group(tp_group)
    if invariant.check_numerics(numerics, "parallelize") == invariant.INVARIANT:
        _check_invariant_options(sequence_parallel=sequence_parallel, compile=compile, cp_group=cp_group)
    resolved, source = _agreed_plan(model, plan, group, example_input, experts_whole)
    if source.endswith((INFERRED_SOURCE, COMPLETED_SOURCE)) and dist.get_rank() == 0:
        print(format_plan(resolved, source), flush=True)
    elif (SKIPPED in source or EXPERTS_KEPT_WHOLE in source) and dist.get_rank() == 0:
        print(f"tensor-parallel plan: {source}", flush=True)
    # Past planning, a failure on one rank ends `parallelize` on every rank with that rank's error, instead of the
    # others waiting in a collective it will not join.
    with failures_agreed(group):
        planned = match_plan(model, resolved, dist.get_world_size(group), example_input)
        heads, vocab_size = _loss_parallel_heads(model, planned, source, loss_parallel) if loss_parallel else ((), None)
        parameter_bytes = sum(param.numel() * param.element_size() for param in model.parameters())
        whole_model = verify or (verify is None and parameter_bytes <= WHOLE_MODEL_CHECK_BYTES)
        skeleton = unsharded_skeleton(model) if whole_model else None  # on the meta device: no memory
        check = SwapCheck(group) if verify is not False else None
        regions = RegionCheck(group, planned) if verify is not False else None
        layout = None
        if sequence_parallel or activation_checkpointing:
            feature = "sequence_parallel" if sequence_parallel else "activation_checkpointing"
            layout = block_layout(model, planned, feature)
            if sequence_parallel:
                check_sequence_parallel(model, layout)
        blocks = layout.blocks if layout is not None else blocks_if_any(model, planned)
        device = torch.device(device) if device is not None else _default_device(model)
        # Also syncs the default generator, so every rank inits alike.
        rng = TensorParallelRNG(group, device, dropout=may_draw_dropout(model))
        if regions is not None:  # the unsharded region modules' arguments and results, before any weight changes
            regions.record(model, example_input)
        if skip and (check is not None or skeleton is not None):
            raise ValueError(
                f"parallelize: skip={sorted(skip)[:3]}... leaves modules on the meta device, which verification runs; "
                f"pass verify=False with skip"
            )
        apply_plan(model, planned, group, rng, device, loss_parallel_heads=heads, check=check, skip=skip)
        if regions is not None:
            regions.check(model)  # before pretrained weights replace those its references were computed with
        load_pretrained_modules(model, group, weights, skip)
        counter = CommunicationCounter()
        if sequence_parallel:
            apply_sequence_parallel(model, layout, group, rng, counter)
        if activation_checkpointing:
            checkpoint_blocks(model, layout.blocks, rng)
        model.tp_rng = rng
        model.tp_blocks = blocks  # the transformer blocks' names, for per-block wrapping (`fully_shard_data_parallel`)
        if vocab_size is not None:
            model.tp_vocab_size = vocab_size
            model.tp_loss_fusion = _head_loss_fusion(model, heads) if numerics == invariant.FAST else None
        model.tp_numerics = numerics
        if numerics == invariant.INVARIANT:
            _configure_invariant(model, group)
        whole_model_errors = None
        if skeleton is not None:
            reference = unsharded_reference(skeleton, model, group)
            with caches_kept(model):  # its probe forward's, from the gradient-tracking pass it backpropagates
                whole_model_errors = verify_parallelized(model, reference, group, planned, example_input)
    if check is not None and dist.get_rank() == 0:
        print(_verification_summary(check, regions, whole_model_errors), flush=True)
    overlap = dist.get_backend(group) == "nccl" if overlap is None else overlap
    model.tp_comm_counter = _configure_layers(model, counter, overlap)
    counter.reset()  # verification's traffic is not training's
    if cp_group is not None:
        enable_context_parallel(model, cp_group, **(cp_options or {}))
    if compile:
        model.compile()
    return model


def _check_invariant_options(**options) -> None:
    """numerics='invariant' covers tensor parallelism's own sums so far: one line for each option it does not."""
    for name, value in options.items():
        if value not in (None, False):
            raise ValueError(
                f"parallelize: numerics='invariant' does not cover {name} yet; leave it off, or use numerics='fast'"
            )


def _configure_invariant(model: nn.Module, group: ProcessGroup) -> None:
    """Every parallel layer of `model` set to `numerics="invariant"`, or one line naming the first that cannot be:
    column layers of one section reading a replicated input, row layers of one section, vocabulary-parallel
    embeddings (a lookup's all-reduce adds one shard's row to zeros: exact), each split as `invariant.check_split`
    allows."""
    ranks = dist.get_world_size(group)
    for name, module in model.named_modules():
        where = f"parallelize: '{name}' ({type(module).__name__})"
        if isinstance(module, ColumnParallelLinear):
            if len(module.shard_specs["weight"].sections) > 1 or module.input_layout != REPLICATED_INPUT:
                raise ValueError(f"{where}: numerics='invariant' takes column layers of one section whose input is "
                                 f"replicated; use numerics='fast' for this model")  # fmt: skip
            invariant.check_split(module.out_features, ranks, where)
        elif isinstance(module, RowParallelLinear):
            if (
                len(module.shard_specs["weight"].sections) > 1
                or module.split_input
                or module.scatter_output
                or (module.partial_output)
            ):
                raise ValueError(f"{where}: numerics='invariant' takes row layers of one section with a split input "
                                 f"and a replicated output; use numerics='fast' for this model")  # fmt: skip
            invariant.check_split(module.in_features, ranks, where)
        elif isinstance(module, Configurable) and not isinstance(module, (VocabParallelEmbedding, SharedInputRegion)):
            raise ValueError(f"{where}: numerics='invariant' does not cover this module's collectives yet; use "
                             f"numerics='fast'")  # fmt: skip
        else:
            continue
        module.configure(numerics=invariant.INVARIANT)


def _agreed_plan(
    model: nn.Module, plan, group: ProcessGroup, example_input, experts_whole: bool
) -> tuple[dict[str, str], str]:
    """`resolve_plan` on the group's first rank, taken by every rank (or its refusal raised on every rank): the
    planner's probes run once per group, a deferred-init model is materialised on the host once, and the ranks cannot
    decide differently (docs/planner.md). Planning leaves the model and the random generators as they were
    (`planning_isolated`), so the rank that planned goes on exactly like those that did not."""
    size = dist.get_world_size(group)

    def decide() -> tuple[dict[str, str], str]:
        with planning_isolated(model):
            return resolve_plan(model, plan, size, example_input, experts_whole)

    return decide() if plan or size == 1 else first_rank_decides(decide, group)


def _loss_parallel_heads(
    model: nn.Module, planned: list[PlannedModule], source: str, loss_parallel: bool | str
) -> tuple[tuple[str, ...], int | None]:
    """The LM head whose logits `loss_parallel` keeps sharded, and its real vocabulary size: the model's output
    embedding (Hugging Face's `get_output_embeddings()`, the module whose output is the logits) where it is planned
    'colwise_gather_output'; else (a model of your own without one) every layer planned so, which must share one
    vocabulary size. Not every gathered layer is a head: OLMoE's own plan gathers q, k and v (issue 41). With
    `loss_parallel="auto"` a model without such a head gets none, ((), None): its logits stay whole (CPM-Ant's and
    Mllama's plans leave the head unsplit)."""
    gathered = {entry.name: entry for entry in planned if entry.style == "colwise_gather_output"}
    output_embeddings = getattr(model, "get_output_embeddings", None)
    head = output_embeddings() if callable(output_embeddings) else None
    for name, entry in gathered.items():
        if head is not None and entry.module is head:
            return (name,), linear_shape(head)[1]
    sizes = {name: linear_shape(entry.module)[1] for name, entry in gathered.items()}
    if len(set(sizes.values())) != 1:
        if loss_parallel == "auto":
            return (), None
        found = ", ".join(f"'{name}' ({size})" for name, size in sizes.items()) or "none"
        raise ValueError(
            f"loss_parallel=True needs the LM head planned 'colwise_gather_output' by {source}: the model's "
            f"get_output_embeddings() is not among the layers planned so, and they do not share one vocabulary size; "
            f"found {found} (plan the LM head 'colwise_gather_output', or pass loss_parallel=False)"
        )
    return tuple(sizes), next(iter(sizes.values()))


def _head_loss_fusion(model: nn.Module, heads: tuple[str, ...]) -> HeadLossFusion | None:
    """A `HeadLossFusion` set on the one vocabulary-parallel head (`heads`: `_loss_parallel_heads`' names), when it
    is a plain column layer without bias (the fused head and loss compute `hidden @ weight.T`); None otherwise."""
    head = model.get_submodule(heads[0]) if len(heads) == 1 else None
    if type(head) is not ColumnParallelLinear or head.bias is not None or len(head.shard_specs["weight"].sections) > 1:
        return None
    fusion = HeadLossFusion()
    head.configure(loss_fusion=fusion)
    return fusion


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


def _configure_layers(model: nn.Module, counter: CommunicationCounter, overlap: bool) -> CommunicationCounter:
    """`counter` for every parallel layer of `model` and the regions its layers enter by (shared input regions, a
    region style's collectives), and backward overlap on or off in those that have it (column layers, their regions)."""
    for module in model.modules():
        for configurable in (module, getattr(module, "input_region", None), getattr(module, "tp_region", None)):
            if isinstance(configurable, Configurable):
                overlaps = {"overlap": overlap} if "overlap" in configurable.SETTINGS else {}
                configurable.configure(comm_counter=counter, **overlaps)
    return counter


def attached(root: nn.Module, attribute: str) -> list:
    """What `parallelize` attached as `attribute` (`tp_rng`, `tp_comm_counter`) to the sharded models inside
    `root`, each object once."""
    found = (getattr(module, attribute, None) for module in root.modules())
    return list({id(value): value for value in found if value is not None}.values())
