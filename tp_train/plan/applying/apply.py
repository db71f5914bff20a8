"""Applying a resolved plan (`match.match_plan` validates it first): each planned module swapped for its
tensor-parallel counterpart, keeping what the module did (docs/planner.md, "What a plan cannot get wrong silently")."""

from __future__ import annotations

import copy
import functools
from collections.abc import Collection
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_reduce_gradient, copy_to_tensor_parallel_region
from tp_train.parallel.layers import (
    ColumnParallelLinear,
    ModuleRegion,
    RowParallelLinear,
    SharedInputRegion,
    VocabParallelEmbedding,
)
from tp_train.parallel.norm import ParallelLayerNormRegion, ParallelRMSNormRegion, norm_epsilon, norm_groups
from tp_train.parallel.pipeline.split import skipped
from tp_train.parallel.pointwise_conv import ColumnParallelPointwiseConv, RowParallelPointwiseConv
from tp_train.parallel.random import REPLICATED, SHARDED, TensorParallelRNG
from tp_train.parallel.reductions import FeatureReductionRegion
from tp_train.parallel.sharding import ShardSpec, replicated_rows, shard_parameter, sum_replicated_gradient
from tp_train.plan.applying.adapters import materialize_adapters, shard_adapters
from tp_train.plan.channels import shard_channels
from tp_train.plan.gradient_hooks import SUM_OVER_RANKS, SUM_REPLICAS, register_gradient_hook
from tp_train.plan.local_view import apply_local_view, parse_attention_style, share_replicated_kv_heads
from tp_train.plan.meta_init import SESSION_KEYS, initializer, materialize, materializing
from tp_train.plan.probe import tensor_caches
from tp_train.plan.styles import (
    FEATURE_REDUCTION_STYLE,
    FEEDS_PARALLEL_REGION,
    LINEAR_STYLES,
    NORM_STYLES,
    REGION_STYLES,
    ROW_STYLES,
    SWAPPED_BASES,
    PlannedModule,
    adapted_base,
    column_layout,
    matrix_shape,
    mla_rope_dim,
    parameter_shard_spec,
    pointwise_conv_shape,
    row_layout,
)


def apply_plan(
    model: nn.Module,
    planned: list[PlannedModule],
    group: ProcessGroup,
    rng: TensorParallelRNG,
    device: torch.device,
    loss_parallel_heads: tuple[str, ...] = (),
    check=None,
    skip: Collection[str] = (),
) -> None:
    """Swaps each planned module for its tensor-parallel counterpart holding this rank's slice of its weights, in
    `named_modules` order, materialising meta tensors on `device` one module at a time (the same initial weights at
    every tp); `check(name, module, layer)` runs right after each swap (`verify.SwapCheck`). The layers named in
    `loss_parallel_heads` keep their output sharded along the vocabulary (no gather). The modules named in `skip`
    (another pipeline stage's, which this rank cuts away) are left as they are, on the meta device: never given
    storage."""
    materialize_adapters(model, device)  # peft's own initialisation, not the model's
    by_name = {entry.name: entry for entry in planned}
    shared: dict[int, tuple] = {}  # tied parameters are sharded once: id(original) -> (original, spec, shard)
    materialized = materializing(model, skip)  # tied meta tensors of unplanned modules are materialised once
    replicated_parents: set[str] = set()  # attentions whose kv heads are replicated, their groups made local
    for name, module in list(model.named_modules()):
        if skipped(name, skip):
            continue
        entry = by_name.get(name)
        style = entry.style if entry else None
        if style in LINEAR_STYLES or style == "embedding_rowwise":
            wrapper = module if adapted_base(module) is not None else None  # a LoRA layer: its base is swapped
            reference = copy.deepcopy(wrapper) if wrapper is not None and check is not None else None
            base = adapted_base(module) or module
            base.tp_origins = dict(base.named_parameters(recurse=False))  # what ties are keyed by
            if not all(id(param) in shared for param in base.tp_origins.values()):
                # Its full tensors die once sliced; a tensor tied to one sharded before stays as it is (its shard is
                # taken, not a fresh draw), one tied to an unplanned module's takes that one's (BERT's decoder:
                # its weight the embedding's, its bias the prediction head's).
                known = {param: materialized.get(param, param) for param in base.tp_origins.values()
                         if id(param) in shared or param in materialized}  # fmt: skip
                known.update({key: materialized[key] for key in SESSION_KEYS})  # one draw, whoever reads it
                materialize(name, base, device, known, initializer(model, name))
            if style == "embedding_rowwise":
                layer = _parallel_embedding(base, group, shared)
            else:
                sharded_output = name in loss_parallel_heads
                layer = _parallel_linear(base, style, group, shared, sharded_output, entry.counts, entry.arguments)
                _sum_replicas(model, name, layer, group, replicated_parents)
            layer = _keep_subclass_forward(base, layer, SWAPPED_BASES[style])
            if wrapper is not None:  # its adapters split to go with the base (tp_train.plan.applying.adapters)
                wrapper.base_layer = layer
                shard_adapters(name, wrapper, layer, style, group, rng)
                checked = (reference, wrapper)  # the LoRA layer as a whole
            else:
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, layer)
                checked = (base, layer)
            if check is not None:
                check(name, *checked)
            if entry.arguments == FEEDS_PARALLEL_REGION:  # after the check, which feeds it replicated gradients
                layer.register_forward_hook(lambda _, __, output: copy_to_tensor_parallel_region(output, group))
            base._parameters.update(base.tp_origins)  # the dropped module lets go of its full tensors
            continue
        materialize(name, module, device, materialized, initializer(model, name))
        if entry is not None and entry.parameters:
            _shard_parameters(module, entry.parameters, group, shared)
        if style in REGION_STYLES:
            module.tp_region = _region(style, group, getattr(model, "config", None), bool(entry.parameters))
            module.tp_region.install(module)
        if style == "attention" or style in REGION_STYLES and entry.arguments:
            # the usual head-count names, or where the style's arguments say the counts are (plan/local_view.py;
            # `moe_tp_experts(ffn_hidden_size)`: the counts its forward views its shards with)
            view = parse_attention_style(f"attention({entry.arguments})") if entry.arguments else None
            apply_local_view(module, view, dist.get_world_size(group), dist.get_rank(group))
        if style == "attention":
            rng.run_in(module, SHARDED)
        elif style == "channelwise":
            shard_channels(module, group, entry.arguments)
        elif style in NORM_STYLES:
            _parallel_norm(module, style, group)
        elif style == FEATURE_REDUCTION_STYLE:  # its parameters split along their last dim, as `rowwise` splits one
            own = dict(module.named_parameters(recurse=False))
            _shard_parameters(module, dict.fromkeys(own, "rowwise"), group, shared)
            module.tp_region = FeatureReductionRegion(group)
            module.tp_region.install(module)
        elif style == "replicated_rng":
            rng.run_in(module, REPLICATED)
        elif style == "replicated_with_grad_allreduce":
            for param_name, _ in module.named_parameters(recurse=False):
                _sum_gradient(module, param_name, group)
    _share_sibling_inputs(model, planned, group)
    _share_ties(model, shared, materialized)


def _share_ties(model: nn.Module, shared: dict, materialized: dict) -> None:
    """Gives every other module still holding a parameter that was sharded (a container tied to a swapped layer's
    parameter, as RoBERTa's `lm_head.bias` is to `lm_head.decoder.bias`) the shard and its split, so the tie holds
    and checkpoints, gathering and export see one tensor under both names; built on meta, the container holds the
    tensor its original was materialised as (`materialized`: the meta original -> it)."""
    originals = {id(real): id(original) for original, real in materialized.items() if id(original) in shared}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            tied = param is not None and (
                id(param) in originals or id(param) in shared and shared[id(param)][0] is param
            )
            if tied:
                _, spec, shard = shared[originals.get(id(param), id(param))]
                module._parameters[key] = shard
                module.shard_specs = {**getattr(module, "shard_specs", {}), key: spec}


# Classes made by `_keep_subclass_forward`, one per (subclass, parallel layer) pair.
_KEPT_FORWARDS: dict[tuple[type, type], type] = {}


def _keep_subclass_forward(module: nn.Module, layer: nn.Module, base: type) -> nn.Module:
    """`layer`, made to run `module`'s forward when `module` is a subclass of `base` that overrides it (Gemma's scaled
    embedding): its class becomes `(type(module), type(layer), base)`, and the subclass's buffers, own parameters,
    attributes and children move to it."""
    cls = type(module)
    code = getattr(cls.forward, "__code__", None)  # a forward calling `super().forward`: the layer goes beneath it
    calls_super = code is not None and "super" in code.co_names and "forward" in code.co_names
    if not isinstance(module, base) or cls.forward is base.forward or not calls_super:
        return layer
    key = (cls, type(layer))
    if key not in _KEPT_FORWARDS:
        name = f"{type(layer).__name__}[{cls.__name__}]"
        _KEPT_FORWARDS[key] = type(name, (cls, type(layer), base), {"__module__": __name__})
    layer.__class__ = _KEPT_FORWARDS[key]
    for key, buffer in module._buffers.items():
        if key not in layer._buffers:
            layer.register_buffer(key, buffer, persistent=key not in module._non_persistent_buffers_set)
    for key, param in module._parameters.items():  # T5Gemma 2's `eoi_embedding`, whole on every rank
        if key not in layer._parameters and not hasattr(layer, key):
            layer.register_parameter(key, param)
    for key, child in module._modules.items():  # Inkling's embedding normalises its lookup with a child norm
        if key not in layer._modules:
            layer.add_module(key, child)
    for key, value in vars(module).items():
        if key not in vars(layer) and key != "tp_origins":  # tp_origins: the full tensors, let go after the swap
            setattr(layer, key, value)
    return layer


def _shard_of(target: nn.Parameter | None, module: nn.Module, name: str, spec: ShardSpec, group, shared: dict):
    """A new parameter holding this rank's shard of `module`'s parameter `name`: shaped like `target`, the swapped
    layer's meta placeholder, or None for a parameter entry. A parameter tied to one sharded before gives that shard
    (a layer's spec may differ from it in `transposed` alone); ties are keyed by the original parameter (held in
    `shared`, so its id is never reused)."""
    source = getattr(module, name)
    origin = module.tp_origins[name] if target is not None else source
    if id(origin) in shared:
        _, previous_spec, previous = shared[id(origin)]
        compared = previous_spec if target is None else replace(previous_spec, transposed=spec.transposed)
        if compared != spec or (target is not None and previous.shape != target.shape):
            raise ValueError(f"a tied parameter is sharded two incompatible ways: {previous_spec} and {spec}")
        return previous
    shard = nn.Parameter(
        shard_parameter(source, spec, dist.get_rank(group), dist.get_world_size(group)),
        requires_grad=source.requires_grad,
    )
    shared[id(origin)] = (origin, spec, shard)
    return shard


def _parallel_linear(
    module: nn.Module, style: str, group: ProcessGroup, shared: dict, loss_parallel: bool, counts=None, arguments=""
) -> nn.Module:
    in_features, out_features = matrix_shape(module)
    pointwise = pointwise_conv_shape(module) is not None  # a 1x1 Conv2d: channels at dim 1, weight (out, in, 1, 1)
    transposed = not pointwise and not isinstance(module, nn.Linear)  # Conv1D stores (in, out)
    row_class = RowParallelPointwiseConv if pointwise else RowParallelLinear
    column_class = ColumnParallelPointwiseConv if pointwise else ColumnParallelLinear
    # Built on meta, with no initialisation of its own: its parameters are the slices of the module's.
    kwargs = dict(bias=module.bias is not None, device="meta", dtype=module.weight.dtype)
    if style in ROW_STYLES:
        kwargs |= dict(split_input=style == "rowwise_split_input", scatter_output=style == "rowwise_scatter_output")
        layer = row_class(in_features, out_features, group, sections=row_layout(in_features, arguments), **kwargs)
    else:
        sections, units = column_layout(style, out_features, counts, arguments)
        gather = style == "colwise_gather_output"
        kwargs |= dict(gather_output=gather and not loss_parallel, pad_output=gather, units=units)
        layer = column_class(in_features, out_features, group, sections=sections, **kwargs)
    for name, spec in list(layer.shard_specs.items()):
        layer.shard_specs[name] = spec = replace(spec, transposed=transposed and name == "weight")
        setattr(layer, name, _shard_of(getattr(layer, name), module, name, spec, group, shared))
    if module.bias is not None and "bias" not in layer.shard_specs:  # a row-parallel bias is replicated
        layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
    return layer


def _parallel_embedding(module: nn.Embedding, group: ProcessGroup, shared: dict) -> VocabParallelEmbedding:
    layer = VocabParallelEmbedding(
        module.num_embeddings, module.embedding_dim, group, module.padding_idx, device="meta", dtype=module.weight.dtype
    )
    layer.weight = _shard_of(layer.weight, module, "weight", layer.shard_specs["weight"], group, shared)
    return layer


def _share_sibling_inputs(model: nn.Module, planned: list[PlannedModule], group: ProcessGroup) -> None:
    """Gives column-parallel siblings (q/k/v, gate/up) one shared entry into the parallel region per parent call."""
    siblings: dict[str, list[ColumnParallelLinear]] = {}
    for entry in planned:
        layer = model.get_submodule(entry.name)
        layer = adapted_base(layer) or layer  # a LoRA layer's base (its adapters read the input apart)
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            siblings.setdefault(entry.name.rpartition(".")[0], []).append(layer)
    for parent_name, layers in siblings.items():
        if len(layers) < 2:
            continue
        region = SharedInputRegion(group, layers=tuple(layers))
        for layer in layers:
            layer.configure(input_region=region)
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_forward_pre_hook(lambda *_, region=region: region.reset())
        parent.register_forward_hook(lambda *_, region=region: region.reset(), always_call=True)


def _sum_replicas(model: nn.Module, name: str, layer: nn.Module, group: ProcessGroup, done: set[str]) -> None:
    """For a column layer whose kv heads are replicated (fewer than ranks): sums their gradients over the replicas,
    and gives its attention (the parent) local query groups and one kv head, once per attention."""
    tp = dist.get_world_size(group)
    spec = getattr(layer, "shard_specs", {}).get("weight")
    copies = max(spec.replicas(tp)) if spec is not None else 1
    if copies == 1:
        return
    for param_name, param_spec in layer.shard_specs.items():
        if getattr(layer, param_name).requires_grad:  # FSDP2's unsharded parameters get the hook too
            hook = functools.partial(sum_replicated_gradient, spec=param_spec, group=group)
            register_gradient_hook(layer, param_name, hook, once=SUM_REPLICAS)
    parent_name = name.rpartition(".")[0]
    if parent_name not in done:
        done.add(parent_name)
        share_replicated_kv_heads(model.get_submodule(parent_name), copies)


def _parallel_norm(module: nn.Module, style: str, group: ProcessGroup) -> None:
    """An RMS norm or a LayerNorm over features split across ranks (`tp_train.parallel.norm`): its weight (and bias)
    split with them, and its output corrected to normalise over every rank's features of its group, unless each rank
    holds whole groups. A gated norm whose groups span ranks normalises this rank's share of its group as one group
    (`group_size`)."""
    gated = style == "gated_rmsnorm_parallel"
    groups = norm_groups(module) if gated else 1
    shard_channels(module, group)  # a LayerNorm's normalized_shape too: its own forward runs on this rank's features
    if gated and groups >= dist.get_world_size(group):
        return
    if gated:
        module.group_size = next(iter(module.parameters(recurse=False))).shape[0]
    if style == "layernorm_parallel":
        module.tp_region = ParallelLayerNormRegion(group, module.eps)
    else:
        module.tp_region = ParallelRMSNormRegion(group, norm_epsilon(module)[1], groups=groups, gated=gated)
    module.tp_region.install(module)


def _shard_parameters(module: nn.Module, styles: dict[str, str], group: ProcessGroup, shared: dict) -> None:
    """Replaces each of `module`'s parameters or buffers that a plan entry names by this rank's shard, recording its
    split in `module.shard_specs` (as the parallel layers do), so that checkpoints, gathering and export see it. The
    gradients of sections held whole by several ranks (fewer units than ranks) are summed over those replicas."""
    rank, world_size = dist.get_rank(group), dist.get_world_size(group)
    specs = getattr(module, "shard_specs", {})
    for cache in tensor_caches(module, recurse=False):  # of the whole parameters (`tp_train.plan.probe`)
        cache.clear()
    for param_name, style in styles.items():
        if style == "replicate_once":
            _count_once(module, param_name, group)
        elif style == "replicated_with_grad_allreduce":  # one parameter of a module planned otherwise (attention)
            _sum_gradient(module, param_name, group)
        spec = parameter_shard_spec(style, module, param_name)
        if spec is None:
            continue
        specs[param_name] = spec
        if param_name in module._buffers:  # not trained, never tied: its slice, persistent or not as it was
            module._buffers[param_name] = shard_parameter(module._buffers[param_name], spec, rank, world_size)
            continue
        module._parameters[param_name] = shard = _shard_of(None, module, param_name, spec, group, shared)
        if shard.requires_grad and replicated_rows(spec, world_size):
            hook = functools.partial(sum_replicated_gradient, spec=spec, group=group)
            register_gradient_hook(module, param_name, hook, once=SUM_REPLICAS)
    module.shard_specs = specs


def _count_once(module: nn.Module, param_name: str, group: ProcessGroup) -> None:
    """`module`'s whole parameter `param_name` enters its forward times 1 on rank 0 and times 0 elsewhere
    (`replicate_once`), so the partial sum its region all-reduces counts it once; its gradient (rank 0's) is summed
    over the ranks. Every rank multiplies, so every rank's backward runs the same steps in the same order (the sum
    is a collective)."""
    _sum_gradient(module, param_name, group)
    scale = 1.0 if dist.get_rank(group) == 0 else 0.0
    kept = {}

    def scaled(module, args):
        kept[param_name] = param = module._parameters[param_name]
        module._parameters[param_name] = param * scale  # a tensor, not a parameter, for this forward only

    def restore(module, args, output):
        module._parameters[param_name] = kept.pop(param_name, module._parameters[param_name])

    module.register_forward_pre_hook(scaled)
    module.register_forward_hook(restore, always_call=True)


def _sum_gradient(module: nn.Module, param_name: str, group: ProcessGroup) -> None:
    """`module`'s whole parameter `param_name` has its gradient summed over the tensor-parallel group."""
    register_gradient_hook(module, param_name, lambda grad: all_reduce_gradient(grad, group), once=SUM_OVER_RANKS)


def _region(style: str, group: ProcessGroup, config=None, own_shards: bool = False) -> ModuleRegion:
    """The collectives around a module of a region style (see `tp_train.plan.styles`). An `all_reduce` module
    whose forward runs its own sharded parameters (`own_shards`: Inkling's shared experts, 3-D weights, no Linears
    whose column layer would) also enters the parallel region: its input's gradient is a partial sum too."""
    if style == "moe_tp_experts":
        return ModuleRegion(group, enter=True, leave=True)
    if style == "moe_identity_expert":
        return ModuleRegion(group, input_scale=1 / dist.get_world_size(group))
    if style == "mla_kv_a_proj":
        return ModuleRegion(group, output_tail=mla_rope_dim(config))
    return ModuleRegion(group, enter=own_shards, leave=True)  # all_reduce
