"""The one reader of tensor-parallel plans.

A plan maps module-name patterns to style names. Patterns are dotted module names in which `*` stands for any
one name component (`"blocks.*.attn.q"`). Style names follow Hugging Face's vocabulary where it has one:

| style                   | module              | what happens                                                     |
|-------------------------|---------------------|------------------------------------------------------------------|
| `colwise`               | Linear / HF Conv1D  | `ColumnParallelLinear`, output sharded (heads, MLP hidden)       |
| `colwise_gather_output` | Linear / HF Conv1D  | `ColumnParallelLinear`, output gathered (an LM head); vocab padded |
| `rowwise`               | Linear / HF Conv1D  | `RowParallelLinear`, input sharded, output all-reduced           |
| `packed_colwise`        | Linear / HF Conv1D  | column split of a packed `[gate; up]` projection, half by half   |
| `fused_qkv_colwise`     | Linear / HF Conv1D  | column split of a fused `[q; k; v]` projection, head-aware       |
| `embedding_rowwise`     | Embedding           | `VocabParallelEmbedding`, vocab rows sharded and padded          |
| `attention`             | attention module    | head-count attributes set to the local heads; its dropout draws  |
|                         |                     | from the per-rank (sharded) random stream                        |
| `replicated_rng`        | any module          | dropout inside draws from the replicated stream again            |
| `replicated_with_grad_allreduce` | any module | its parameters stay whole; their gradients are summed over the TP |
|                         |                     | group (a norm applied to each rank's local heads, e.g. QK-norm)  |
| `replicate`             | any module          | left as it is (every rank holds it whole)                        |

`colwise_rep` is accepted as Hugging Face's older name for `colwise_gather_output`.

A swap keeps what the module did: a subclass of `nn.Embedding` or `nn.Linear` that overrides `forward` (Gemma's
embedding, which scales its output) keeps that forward, its `super().forward` now reaching the sharded
computation. A subclass whose forward never calls `super().forward` (Falcon's Linear computes `x @ W.T + b` itself)
gets the plain parallel layer, and verification's per-module check (`tp_train.verify.SwapCheck`, on by default)
refuses it in one line unless the two compute the same. A parameter two modules share (a tied embedding
and head) is sharded alike on both sides: the unplanned side of a tied embedding/head pair is planned to match,
any other half-sharded tie is refused.

Reading a plan is two passes: `match_plan` resolves and validates everything (raising `ValueError` before any
weight changes), then `apply_plan` swaps the layers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.comm import all_reduce_gradient
from tp_train.layers import ColumnParallelLinear, RowParallelLinear, SharedInputRegion, VocabParallelEmbedding
from tp_train.presets import preset_plan
from tp_train.random import REPLICATED, SHARDED, TensorParallelRNG
from tp_train.sharding import ShardSpec, shard_tensor

LINEAR_STYLES = {"colwise", "colwise_gather_output", "rowwise", "packed_colwise", "fused_qkv_colwise"}
STYLES = LINEAR_STYLES | {
    "embedding_rowwise",
    "attention",
    "replicated_rng",
    "replicated_with_grad_allreduce",
    "replicate",
}
ALIASES = {"colwise_rep": "colwise_gather_output"}
PACKED_SECTIONS = {"packed_colwise": 2, "fused_qkv_colwise": 3}

# Attributes an attention module may keep that count its heads, or its width across heads (heads x head_dim).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "all_head_size", "inner_dim")
# Config fields that hold head counts, checked whenever a model with such a config is sharded.
CONFIG_HEAD_FIELDS = HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES


@dataclass
class PlannedModule:
    name: str
    module: nn.Module
    style: str
    pattern: str


def find_plan(model: nn.Module) -> tuple[dict[str, str], str] | None:
    """The model's own plan and where it came from: its `tp_plan`, the Hugging Face plan (`base_model_tp_plan`
    and the head's `_tp_plan`, as transformers merges them), or a built-in preset; None when it has none."""
    # transformers models expose their merged plan as both `tp_plan` (a property) and `_tp_plan`.
    hugging_face_plan = getattr(model, "_tp_plan", None)
    own_plan = getattr(model, "tp_plan", None)
    if own_plan and own_plan != hugging_face_plan:
        return dict(own_plan), f"{type(model).__name__}.tp_plan"
    if hugging_face_plan:
        return dict(hugging_face_plan), f"{type(model).__name__}'s Hugging Face base_model_tp_plan"
    preset = preset_plan(model)
    if preset:
        return preset, f"the built-in preset for model_type '{model.config.model_type}'"
    return None


def resolve_plan(
    model: nn.Module, plan: dict[str, str] | None = None, tensor_parallel_size: int | None = None
) -> tuple[dict[str, str], str]:
    """The plan to use and where it came from: the `plan` argument, else the model's own (`find_plan`), else the
    auto-planner's, checked at `tensor_parallel_size` (`tp_train.autoplan`)."""
    if plan:
        return dict(plan), "the plan argument"
    from tp_train.autoplan import COMPLETED_SOURCE, INFERRED_SOURCE, infer_plan  # imported here: it reads this module

    found = find_plan(model)
    if found is not None and not _leaves_blocks_untouched(model, found[0]):
        return found
    if tensor_parallel_size:
        _check_config_heads(model, tensor_parallel_size)
    try:
        inferred = infer_plan(model, tensor_parallel_size)
    except ValueError as error:
        what = (
            f"{found[1]} shards no transformer block"
            if found
            else f"no tensor-parallel plan for {type(model).__name__}"
        )
        raise ValueError(
            f"{what}, and {error} (a `tp_plan` attribute or plan= looks like "
            f"{{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}})"
        ) from None
    if found is None:
        return inferred, INFERRED_SOURCE
    # The model's own entries win; the auto-planner's fill in the blocks (a head-only plan, as LFM2's).
    return {**inferred, **found[0]}, f"{found[1]}, {COMPLETED_SOURCE}"


def _leaves_blocks_untouched(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether `model` has Linears inside repeated blocks (`layers.0.mlp.up`) and `plan` shards none of them."""
    block_linears = [
        name
        for name, module in model.named_modules()
        if _linear_shape(module) is not None and any(part.isdigit() for part in name.split("."))
    ]
    sharding = [pattern for pattern, style in plan.items() if ALIASES.get(style, style) in LINEAR_STYLES]
    return bool(block_linears) and not any(
        pattern_matches(pattern, name) for pattern in sharding for name in block_linears
    )


def modules_with_plans(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules under (and including) `root` that carry a plan of their own, by name."""
    found = []

    def visit(name: str, module: nn.Module) -> None:
        if find_plan(module) is not None:
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return found


def pattern_matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names, strict=True))


def match_plan(model: nn.Module, plan: dict[str, str], tp: int) -> list[PlannedModule]:
    """Every module the plan names, with its style, after checking that the plan applies at this tp."""
    _check_config_heads(model, tp)
    planned: dict[str, PlannedModule] = {}
    for pattern, style in plan.items():
        style = ALIASES.get(style, style)
        if style not in STYLES:
            raise ValueError(
                f"plan entry '{pattern}': unknown style '{style}'; known styles: {', '.join(sorted(STYLES))}"
            )
        matches = [(name, module) for name, module in model.named_modules() if pattern_matches(pattern, name)]
        if not matches:
            raise ValueError(
                f"plan entry '{pattern}' matches no module of {type(model).__name__}; "
                f"module names look like {_example_names(model)}"
            )
        for name, module in matches:
            if name in planned and planned[name].style != style:
                raise ValueError(
                    f"module '{name}' is planned twice: '{planned[name].style}' by '{planned[name].pattern}' "
                    f"and '{style}' by '{pattern}'; keep one"
                )
            _check_module(name, module, style, pattern, tp)
            planned[name] = PlannedModule(name, module, style, pattern)
    for entry in _tie_completions(model, planned):
        _check_module(entry.name, entry.module, entry.style, entry.pattern, tp)
        planned[entry.name] = entry
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(planned.values(), key=lambda entry: order[entry.name])


def apply_plan(
    model: nn.Module,
    planned: list[PlannedModule],
    group: ProcessGroup,
    rng: TensorParallelRNG,
    device: torch.device,
    loss_parallel: bool = False,
    check=None,
) -> None:
    """Swaps each planned module for its tensor-parallel counterpart, holding this rank's slice of its weights.

    Modules are visited in `named_modules` order. Tensors still on the meta device are materialised on `device`
    on the way, one module at a time, and initialised by the model's per-module `_init_weights(module)` where it
    has one (Hugging Face's convention), else by the module's own `reset_parameters()`. A planned module is
    materialised whole, sliced, and dropped, so peak memory is the shards plus one full layer, and the random
    numbers drawn (hence the initial weights) are the same at every tp. `check(name, module, layer)`, when given,
    runs right after each swap while the replaced module still holds its full tensors (`tp_train.verify`'s
    `SwapCheck`, a collective).
    """
    init_weights = getattr(model, "_init_weights", None)
    by_name = {entry.name: entry for entry in planned}
    shared: dict[int, tuple] = {}  # tied parameters are sharded once: id(original) -> (original, spec, shard)
    materialized: dict[int, torch.Tensor] = {}  # tied meta tensors of unplanned modules are materialised once
    for name, module in list(model.named_modules()):
        entry = by_name.get(name)
        style = entry.style if entry else None
        if style in LINEAR_STYLES or style == "embedding_rowwise":
            module.tp_origins = dict(module.named_parameters(recurse=False))  # what ties are keyed by
            if not all(id(param) in shared for param in module.tp_origins.values()):
                _materialize(name, module, device, {}, init_weights)  # its full tensors die once sliced
            if style == "embedding_rowwise":
                layer = _parallel_embedding(module, group, shared)
            else:
                layer = _parallel_linear(module, style, group, shared, loss_parallel)
            layer = _keep_subclass_forward(module, layer, SWAPPED_BASES[style])
            _set_submodule(model, name, layer)
            if check is not None:
                check(name, module, layer)
            module._parameters.update(module.tp_origins)  # the dropped module lets go of its full tensors
            continue
        _materialize(name, module, device, materialized, init_weights)
        if style == "attention":
            _localize_heads(module, dist.get_world_size(group))
            rng.run_in(module, SHARDED)
        elif style == "replicated_rng":
            rng.run_in(module, REPLICATED)
        elif style == "replicated_with_grad_allreduce":
            for param in module.parameters(recurse=False):
                param.register_hook(lambda grad: all_reduce_gradient(grad, group))
    _share_sibling_inputs(model, planned, group)


def _materialize(name: str, module: nn.Module, device: torch.device, materialized: dict, init_weights=None) -> None:
    """Gives `module`'s own meta-device tensors storage on `device` and initialises them: `init_weights(module)`
    when given, else `module.reset_parameters()`."""
    fresh = False
    for tensors in (module._parameters, module._buffers):
        for key, tensor in tensors.items():
            if tensor is None or not tensor.is_meta:
                continue
            if id(tensor) not in materialized:
                real = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                materialized[id(tensor)] = real
                fresh = True
            tensors[key] = materialized[id(tensor)]
    if not fresh:
        return
    if init_weights is not None:
        init_weights(module)
        return
    if not hasattr(module, "reset_parameters"):
        raise ValueError(
            f"module '{name}' ({type(module).__name__}) was built on the meta device but has no reset_parameters() "
            f"to initialise it; define one, or build the model on a real device"
        )
    module.reset_parameters()


# ----------------------------------------------------------------------------------------------- validation

# How a style leaves each parameter it swaps: sharded along the vocabulary (an embedding and a head tied to it
# split alike), split by the style itself, or "whole" (unplanned, or a style that swaps nothing). A row layer's
# bias is copied into the new layer, so no tie can follow it.
VOCABULARY_SPLIT = "vocabulary"


def _split_of(style: str | None, param_name: str) -> str:
    if style in ("embedding_rowwise", "colwise_gather_output"):
        return VOCABULARY_SPLIT
    if style == "rowwise" and param_name == "bias":
        return "copied (a row layer's bias)"
    return style if style in LINEAR_STYLES else "whole"


def _vocabulary_style(module: nn.Module) -> str | None:
    """The vocabulary-parallel style for an embedding or a head (a Linear), else None."""
    if isinstance(module, nn.Embedding):
        return "embedding_rowwise"
    return "colwise_gather_output" if _linear_shape(module) is not None else None


def _tie_completions(model: nn.Module, planned: dict[str, PlannedModule]) -> list[PlannedModule]:
    """Entries that make every shared parameter split alike on each module holding it: the unplanned embedding of
    a tied pair whose head is sharded (or the head of a sharded embedding). Any other tie split on one side only,
    or two ways, is refused in one line naming both modules (sharding one side would silently untie them)."""
    holders: dict[int, dict[tuple[int, str], tuple[str, str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), {}).setdefault(
                    (id(module), param_name), (module_name, param_name, module)
                )
    completions = []
    for tied in holders.values():
        sides = [(name, key, module, _split_of(getattr(planned.get(name), "style", None), key))
                 for name, key, module in tied.values()]  # fmt: skip
        splits = {split for *_, split in sides}
        if len(tied) < 2 or (len(splits) == 1 and not splits & {"copied (a row layer's bias)"}):
            continue
        unplanned = [side for side in sides if side[3] == "whole"]
        if splits == {"whole", VOCABULARY_SPLIT} and all(
            key == "weight" and name not in planned and _vocabulary_style(module) for name, key, module, _ in unplanned
        ):
            completions += [PlannedModule(name, module, _vocabulary_style(module), f"{name} (tied)")
                            for name, _, module, _ in unplanned]  # fmt: skip
            continue
        first = next(side for side in sides if side[3] != "whole")
        second = next(side for side in sides if side is not first and (side[3] != first[3] or len(splits) == 1))
        raise ValueError(
            f"'{first[0]}.{first[1]}' is the same parameter as '{second[0]}.{second[1]}', and the plan splits it "
            f"{first[3]} in '{first[0]}' but {second[3]} in '{second[0]}': a tie must be split alike on both sides; "
            f"plan both modules alike (a tied embedding 'embedding_rowwise' with its head 'colwise_gather_output'), "
            f"or leave both replicated"
        )
    return completions


def _check_config_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for field in CONFIG_HEAD_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp:
            replication = " (replicating kv heads is not supported)" if field in KV_HEAD_ATTRIBUTES else ""
            raise ValueError(
                f"config.{field}={value} is not divisible by tensor_parallel_size={tp}: each rank must hold whole "
                f"heads{replication}; use a tensor_parallel_size in {_divisors(value)}"
            )


def _linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of an nn.Linear or a Hugging Face Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.shape[0], module.weight.shape[1]
    return None


def _check_module(name: str, module: nn.Module, style: str, pattern: str, tp: int) -> None:
    where = f"plan entry '{pattern}': module '{name}' ({type(module).__name__})"
    if style in LINEAR_STYLES:
        shape = _linear_shape(module)
        if shape is None:
            raise ValueError(f"{where} cannot take style '{style}': it needs an nn.Linear or a Conv1D")
        in_features, out_features = shape
        if style == "rowwise":
            _check_divisible(where, "in_features", in_features, tp)
        elif style in PACKED_SECTIONS:
            sections = PACKED_SECTIONS[style]
            if out_features % sections:
                raise ValueError(f"{where}: out_features={out_features} does not split into {sections} sections")
            _check_divisible(where, f"out_features/{sections}", out_features // sections, tp)
        elif style == "colwise":
            _check_divisible(where, "out_features", out_features, tp)
    elif style == "embedding_rowwise":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where} cannot take style '{style}': it needs an nn.Embedding")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{where}: max_norm, sparse and scale_grad_by_freq are not supported when sharded")
    elif style == "attention":
        for attribute in HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES + WIDTH_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int):
                _check_divisible(where, attribute, value, tp)


# The class each swapping style replaces; a subclass's own forward is kept around the sharded layer.
SWAPPED_BASES = {style: nn.Linear for style in LINEAR_STYLES} | {"embedding_rowwise": nn.Embedding}


def _calls_super_forward(cls: type) -> bool:
    """Whether `cls.forward` calls `super().forward` (so a parallel layer can take the base's place beneath it)."""
    code = getattr(cls.forward, "__code__", None)
    return code is not None and "super" in code.co_names and "forward" in code.co_names


def _check_divisible(where: str, dimension: str, value: int, tp: int) -> None:
    if value % tp:
        raise ValueError(
            f"{where}: {dimension}={value} is not divisible by tensor_parallel_size={tp}; "
            f"use a tensor_parallel_size in {_divisors(value)}"
        )


def _divisors(value: int) -> list[int]:
    return [d for d in range(1, value + 1) if value % d == 0 and d <= 64]


def _example_names(model: nn.Module) -> str:
    names = [name for name, _ in model.named_modules() if name][:4]
    return ", ".join(f"'{name}'" for name in names) + ", ..."


# ---------------------------------------------------------------------------------------------- application


def _set_submodule(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


# Classes made by `_keep_subclass_forward`, one per (subclass, parallel layer) pair.
_KEPT_FORWARDS: dict[tuple[type, type], type] = {}


def _keep_subclass_forward(module: nn.Module, layer: nn.Module, base: type) -> nn.Module:
    """`layer`, made to run `module`'s forward when `module` is a subclass of `base` that overrides it.

    The layer's class becomes `(type(module), type(layer), base)`: in that order the subclass's `super().forward`
    reaches the parallel layer's forward, so Gemma's `super().forward(ids) * embed_scale` scales the sharded
    lookup. What the subclass keeps besides parameters (its buffers, such as `embed_scale`, and attributes) moves
    to the layer. A subclass whose forward never calls `super().forward` keeps the plain layer (see the module
    docstring).
    """
    cls = type(module)
    if not isinstance(module, base) or cls.forward is base.forward or not _calls_super_forward(cls):
        return layer
    key = (cls, type(layer))
    if key not in _KEPT_FORWARDS:
        name = f"{type(layer).__name__}[{cls.__name__}]"
        _KEPT_FORWARDS[key] = type(name, (cls, type(layer), base), {"__module__": __name__})
    layer.__class__ = _KEPT_FORWARDS[key]
    for key, buffer in module._buffers.items():
        if key not in layer._buffers:
            layer.register_buffer(key, buffer, persistent=key not in module._non_persistent_buffers_set)
    for key, value in vars(module).items():
        if key not in vars(layer) and key != "tp_origins":  # tp_origins: the full tensors, let go after the swap
            setattr(layer, key, value)
    return layer


def _shard_of(target: nn.Parameter, module: nn.Module, name: str, spec: ShardSpec, group, shared: dict):
    """A new parameter holding this rank's shard of `module`'s parameter `name`, shaped like `target` (the layer's
    meta placeholder). A parameter tied to one sharded before gives that shard; ties are keyed by the original
    parameter (held in `shared`, so its id is never reused)."""
    origin, source = module.tp_origins[name], getattr(module, name)
    if id(origin) in shared:
        _, previous_spec, previous = shared[id(origin)]
        if replace(previous_spec, transposed=spec.transposed) != spec or previous.shape != target.shape:
            raise ValueError(f"a tied parameter is sharded two incompatible ways: {previous_spec} and {spec}")
        return previous
    full = source.detach().t() if spec.transposed else source.detach()
    shard = nn.Parameter(
        shard_tensor(full, spec, dist.get_rank(group), dist.get_world_size(group)), requires_grad=source.requires_grad
    )
    shared[id(origin)] = (origin, spec, shard)
    return shard


def _parallel_linear(module: nn.Module, style: str, group: ProcessGroup, shared: dict, loss_parallel: bool):
    in_features, out_features = _linear_shape(module)
    transposed = not isinstance(module, nn.Linear)  # Conv1D stores (in, out)
    # Built on meta, with no initialisation of its own: its parameters are the slices of the module's.
    kwargs = dict(bias=module.bias is not None, device="meta", dtype=module.weight.dtype)
    if style == "rowwise":
        layer = RowParallelLinear(in_features, out_features, group, **kwargs)
    else:
        sections = PACKED_SECTIONS.get(style, 1)
        layer = ColumnParallelLinear(
            in_features,
            out_features,
            group,
            gather_output=style == "colwise_gather_output" and not loss_parallel,
            sections=(out_features // sections,) * sections,
            pad_output=style == "colwise_gather_output",
            **kwargs,
        )
    for name in list(layer.shard_specs):
        layer.shard_specs[name] = replace(layer.shard_specs[name], transposed=transposed and name == "weight")
    layer.weight = _shard_of(layer.weight, module, "weight", layer.shard_specs["weight"], group, shared)
    if module.bias is not None:
        if "bias" in layer.shard_specs:
            layer.bias = _shard_of(layer.bias, module, "bias", layer.shard_specs["bias"], group, shared)
        else:  # a row-parallel bias is replicated
            layer.bias = nn.Parameter(module.bias.detach().clone(), requires_grad=module.bias.requires_grad)
    return layer


def _parallel_embedding(module: nn.Embedding, group: ProcessGroup, shared: dict) -> VocabParallelEmbedding:
    layer = VocabParallelEmbedding(
        module.num_embeddings,
        module.embedding_dim,
        group,
        padding_idx=module.padding_idx,
        device="meta",
        dtype=module.weight.dtype,
    )
    layer.weight = _shard_of(layer.weight, module, "weight", layer.shard_specs["weight"], group, shared)
    return layer


def _share_sibling_inputs(model: nn.Module, planned: list[PlannedModule], group: ProcessGroup) -> None:
    """Gives column-parallel siblings (q/k/v, gate/up) one shared entry into the parallel region per parent call."""
    siblings: dict[str, list[ColumnParallelLinear]] = {}
    for entry in planned:
        layer = model.get_submodule(entry.name)
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            siblings.setdefault(entry.name.rpartition(".")[0], []).append(layer)
    for parent_name, layers in siblings.items():
        if len(layers) < 2:
            continue
        region = SharedInputRegion(group)
        for layer in layers:
            layer.input_region = region
        parent = model.get_submodule(parent_name) if parent_name else model
        parent.register_forward_pre_hook(lambda *_, region=region: region.reset())
        parent.register_forward_hook(lambda *_, region=region: region.reset(), always_call=True)


def _localize_heads(module: nn.Module, tp: int) -> None:
    """Rewrites an attention module's head counts and head widths to this rank's share."""
    for attribute in HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES + WIDTH_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, int):
            setattr(module, attribute, value // tp)
