"""Resolving a plan against a model: every module each entry names, with its style, validated before any weight
changes (`ValueError`, one line, naming the entry, the module and what would work), and the entries that keep a
parameter two modules share split alike on both (`tie_completions`)."""

from __future__ import annotations

import torch.nn as nn

from tp_train.parallel.norm import EPSILON_ATTRIBUTES, is_layer_norm, norm_epsilon, norm_groups
from tp_train.parallel.sharding import check_divisible, check_sections, divisors
from tp_train.plan.deciding.head_shapes import attention_of, grouped_without_counts, observed_counts
from tp_train.plan.local_view import field_and_sections, field_value, parse_attention_style, usual_fields
from tp_train.plan.styles import (
    ALIASES,
    FEATURE_REDUCTION_STYLE,
    KV_HEAD_ATTRIBUTES,
    LINEAR_STYLES,
    NORM_STYLES,
    PACKED_SECTIONS,
    ROW_STYLES,
    SECTIONED_STYLES,
    STYLES,
    HeadCounts,
    PlannedModule,
    check_style,
    column_layout,
    head_counts,
    linear_shape,
    matrix_shape,
    mla_rope_dim,
    parameter_shard_spec,
    pattern_matches,
    section_sizes,
    section_units,
)


def match_plan(model: nn.Module, plan: dict[str, str], tp: int, example_input=None) -> list[PlannedModule]:
    """Every module the plan names, with its style (and the styles of entries naming its parameters), after checking
    that the plan applies at this tp (the config's head counts are checked once, by `resolve_plan`). A column layer's
    head counts come from its attention module or the model's config, or, for grouped-query attention they do not
    explain, from the attention's own reshape in a probe forward on `example_input`
    (`tp_train.plan.deciding.head_shapes`)."""
    config = getattr(model, "config", None)
    observed = _observed_counts(model, plan, example_input) if tp > 1 else {}
    planned: dict[str, PlannedModule] = {}
    parameter_entries = []
    for pattern, style in plan.items():
        style, arguments = check_style(pattern, style)
        matches = [(name, module) for name, module in model.named_modules() if pattern_matches(pattern, name)]
        if not matches:
            parameters = _matching_parameters(model, pattern)
            if not parameters:
                names = ", ".join(f"'{name}'" for name in [name for name, _ in model.named_modules() if name][:4])
                raise ValueError(
                    f"plan entry '{pattern}' matches no module or parameter of {type(model).__name__}; "
                    f"module names look like {names}, ..."
                )
            parameter_entries.append((pattern, f"{style}({arguments})" if arguments else style, parameters))
            continue
        if style not in STYLES:
            raise ValueError(f"plan entry '{pattern}': style '{style}' applies to parameters, not modules")
        for name, module in matches:
            if name in planned and planned[name].style != style:
                raise ValueError(
                    f"module '{name}' is planned twice: '{planned[name].style}' by '{planned[name].pattern}' "
                    f"and '{style}' by '{pattern}'; keep one"
                )
            counts = None
            if style in LINEAR_STYLES - ROW_STYLES:
                parent = name.rpartition(".")[0]
                counts = observed.get(name) or head_counts(model.get_submodule(parent) if parent else None, config)
            _check_module(name, module, style, pattern, tp, counts, arguments)
            if style == "mla_kv_a_proj":
                mla_rope_dim(config)
            planned[name] = PlannedModule(name, module, style, pattern, arguments, counts=counts)
    for pattern, style, parameters in parameter_entries:
        for name, module, param_name in parameters:
            entry = planned.setdefault(name, PlannedModule(name, module, "local_params", pattern))
            _check_parameter(entry, param_name, style, pattern, tp)
            entry.parameters[param_name] = style
    for entry in planned.values():
        if entry.style not in {"moe_tp_experts", "all_reduce"}:
            continue
        inside = (other for name, other in planned.items() if name == entry.name or name.startswith(entry.name + "."))
        if not any(other.parameters or other.style in LINEAR_STYLES for other in inside):
            raise ValueError(
                f"plan entry '{entry.pattern}': module '{entry.name}' is '{entry.style}' but the plan shards none of "
                f"its parameters or layers, so its all-reduce would add tp copies; plan its weights too "
                f"(e.g. '{entry.name}.gate_up_proj': 'packed_colwise', '{entry.name}.down_proj': 'rowwise')"
            )
    for entry in tie_completions(model, planned):
        _check_module(entry.name, entry.module, entry.style, entry.pattern, tp)
        planned[entry.name] = entry
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(planned.values(), key=lambda entry: order[entry.name])


def _observed_counts(model: nn.Module, plan: dict[str, str], example_input) -> dict[str, HeadCounts]:
    """Head counts read off the reshapes of the plain `colwise` layers of attentions whose module and config do not
    explain their narrower (kv) projections; {} where there are none (no probe forward is run)."""
    columns = [
        name
        for pattern, style in plan.items()
        if ALIASES.get(style, style) == "colwise"
        for name, _ in model.named_modules()
        if pattern_matches(pattern, name)
    ]
    parents = set(grouped_without_counts(model, columns))
    inside = [name for name in columns if attention_of(name, columns) in parents]
    return observed_counts(model, inside, example_input) if inside else {}


def names_anything(model: nn.Module, pattern: str) -> bool:
    """Whether `pattern` matches a module or a parameter of `model`."""
    names = (name for name, _ in model.named_modules())
    return any(pattern_matches(pattern, name) for name in names) or bool(_matching_parameters(model, pattern))


def _matching_parameters(model: nn.Module, pattern: str) -> list[tuple[str, nn.Module, str]]:
    """(module name, module, tensor name) of every parameter or buffer whose full name `pattern` matches (a buffer
    that acts on a split activation, as Falcon-H1's `mup_vector` scales in_proj's output, is split with it)."""
    return [
        (name, module, param_name)
        for name, module in model.named_modules()
        for tensors in (module._parameters, module._buffers)
        for param_name, param in tensors.items()
        if param is not None and pattern_matches(pattern, f"{name}.{param_name}" if name else param_name)
    ]


def _check_parameter(entry: PlannedModule, param_name: str, style: str, pattern: str, tp: int) -> None:
    shape = tuple(getattr(entry.module, param_name).shape)
    where = f"plan entry '{pattern}': parameter '{entry.name}.{param_name}' {shape}"
    if entry.style in LINEAR_STYLES or entry.style == "embedding_rowwise":
        raise ValueError(f"{where}: its module is swapped whole as '{entry.style}'; plan the module or the parameter")
    previous = entry.parameters.get(param_name)
    if previous is not None and previous != style:
        raise ValueError(f"{where} is planned twice: '{previous}' and '{style}'; keep one")
    try:
        spec = parameter_shard_spec(style, entry.module, param_name)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    if spec is not None:
        check_sections(where, f"dim {spec.dim}", spec.sections, spec.units, tp)


def _check_module(
    name: str,
    module: nn.Module,
    style: str,
    pattern: str,
    tp: int,
    counts: HeadCounts | None = None,
    arguments: str = "",
) -> None:
    where = f"plan entry '{pattern}': module '{name}' ({type(module).__name__})"
    if arguments and style in SECTIONED_STYLES and not section_sizes(arguments):
        raise ValueError(f"{where}: '{style}({arguments})' must name section sizes, e.g. '{style}(64,16,16)'")
    if style in LINEAR_STYLES:
        shape = matrix_shape(module)
        if shape is None:
            raise ValueError(
                f"{where} cannot take style '{style}': it needs an nn.Linear, a Conv1D or a 1x1 Conv2d (stride 1, no "
                "padding, one group)"
            )
        if linear_shape(module) is None and (style not in ("colwise", "rowwise") or arguments):
            raise ValueError(f"{where} is a 1x1 Conv2d: it takes 'colwise' or 'rowwise' (no arguments), not '{style}'")
        in_features, out_features = shape
        if style in ROW_STYLES:
            named = section_sizes(arguments)
            if named and (style != "rowwise" or sum(named) != in_features):
                raise ValueError(
                    f"{where}: '{style}({arguments})' must be 'rowwise' naming sections of in_features={in_features}"
                )
            for size in named or (in_features,):
                check_divisible(where, "in_features" + (" (per section)" if named else ""), size, tp)
            if style == "rowwise_scatter_output":  # each rank keeps whole outputs (its kv heads'), never replicas
                check_divisible(where, "out_features", out_features, tp)
        elif style in PACKED_SECTIONS or style == "colwise":
            sections, units = column_layout(style, out_features, counts, arguments)
            if section_sizes(arguments) and sum(sections) != out_features:
                raise ValueError(f"{where}: sections {sections} do not add up to out_features={out_features}")
            if sum(sections) != out_features:
                raise ValueError(f"{where}: out_features={out_features} does not split into {len(sections)} sections")
            check_sections(where, "out_features", sections, units, tp)
    elif style == FEATURE_REDUCTION_STYLE:
        for param_name, param in module.named_parameters(recurse=False):
            if not param.dim():
                raise ValueError(f"{where} cannot take style '{style}': its {param_name} is a scalar, not per feature")
            check_divisible(where, f"{param_name}.shape[-1]", param.shape[-1], tp)
    elif style == "layernorm_parallel" and not (is_layer_norm(module) and module.elementwise_affine):
        raise ValueError(
            f"{where} cannot take style '{style}': it needs an nn.LayerNorm over its last dimension alone with its "
            f"weight (an RMS norm takes 'rmsnorm_parallel')"
        )
    elif style in NORM_STYLES:
        found, _ = norm_epsilon(module)
        weights = [param for param in module.parameters(recurse=False) if param.dim() == 1]
        if not found or len(weights) != len(list(module.parameters(recurse=False))):
            raise ValueError(
                f"{where} cannot take style '{style}': it needs an RMS norm with 1-D weights and its epsilon in one "
                f"of the attributes {', '.join(EPSILON_ATTRIBUTES)}"
            )
        for param_name, param in module.named_parameters(recurse=False):
            check_divisible(where, f"{param_name}.shape[0]", param.shape[0], tp)
        # a gated norm's groups: whole on each rank (tp divides them) or each spanning tp / groups ranks
        if style == "gated_rmsnorm_parallel" and (groups := norm_groups(module)) % tp and tp % groups:
            raise ValueError(
                f"{where}: its {groups} groups of group_size={module.group_size} neither divide nor are divisible by "
                f"tensor_parallel_size={tp}; use a tensor_parallel_size in {divisors(groups)} or one {groups} divides"
            )
    elif style == "channelwise":
        named = section_sizes(arguments)
        for param_name, param in module.named_parameters(recurse=False):
            channels = param.shape[0] if param.dim() else 1
            if named and sum(named) != channels:
                raise ValueError(f"{where}: sections {named} do not add up to {param_name}.shape[0]={channels}")
            check_sections(where, f"{param_name}.shape[0]", named or (channels,), section_units(arguments), tp)
    elif style == "embedding_rowwise":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where} cannot take style '{style}': it needs an nn.Embedding")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{where}: max_norm, sparse and scale_grad_by_freq are not supported when sharded")
    elif style == "attention" or style == "moe_tp_experts" and arguments:
        # each count its view makes local (plain `attention`: the usual attributes), evenly or by its sections' units
        fields = parse_attention_style(f"attention({arguments})").fields if arguments else usual_fields(module)
        for item in fields:
            path, sections = field_and_sections(item)
            value = field_value(module, path)
            kv = path.rpartition(".")[2] in KV_HEAD_ATTRIBUTES
            replicated = kv and isinstance(value, int) and value and not tp % value
            if isinstance(value, int) and sections:
                if sum(section_sizes(sections)) != value:
                    raise ValueError(f"{where}: '{item}' names sections that do not add up to {path}={value}")
                check_sections(where, path, section_sizes(sections), section_units(sections), tp, stored=False)
            elif isinstance(value, int) and not replicated:
                check_divisible(where, path, value, tp)


# Shared parameters under a plan: a parameter two modules hold (a tied embedding and head) must be split alike
# on both, or on neither; sharding one side would silently untie them.


# How a style leaves each parameter it swaps: sharded along the vocabulary (an embedding and a head tied to it
# split alike), split by the style itself, or "whole" (unplanned, or a style that swaps nothing). A row layer's
# bias is copied into the new layer, so no tie can follow it.
VOCABULARY_SPLIT = "vocabulary"


def _split_of(entry: PlannedModule | None, param_name: str) -> str:
    style = entry.style if entry else None
    if entry is not None and entry.parameters.get(param_name, "replicate") != "replicate":
        return f"{entry.parameters[param_name]} (a parameter entry)"
    if style in ("embedding_rowwise", "colwise_gather_output"):
        return VOCABULARY_SPLIT
    if style == "rowwise" and param_name == "bias":
        return "copied (a row layer's bias)"
    return style if style in LINEAR_STYLES else "whole"


def _vocabulary_style(module: nn.Module) -> str | None:
    """The vocabulary-parallel style for an embedding or a head (a Linear), else None."""
    if isinstance(module, nn.Embedding):
        return "embedding_rowwise"
    return "colwise_gather_output" if linear_shape(module) is not None else None


def tie_completions(model: nn.Module, planned: dict[str, PlannedModule]) -> list[PlannedModule]:
    """Entries that make every shared parameter split alike on each module holding it (the unplanned embedding of a tied
    sharded head, or the other way round); any other tie split on one side only, or two ways, is refused in one line."""
    holders: dict[int, dict[tuple[int, str], tuple[str, str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), {}).setdefault(
                    (id(module), param_name), (module_name, param_name, module)
                )
    completions = []
    for tied in holders.values():
        sides = [(name, key, module, _split_of(planned.get(name), key))
                 for name, key, module in tied.values()]  # fmt: skip
        splits = {split for *_, split in sides}
        if len(tied) < 2 or (len(splits) == 1 and not splits & {"copied (a row layer's bias)"}):
            continue
        unplanned = [side for side in sides if side[3] == "whole"]
        if splits == {"whole", VOCABULARY_SPLIT} and all(
            name not in planned and linear_shape(module) is None and not isinstance(module, nn.Embedding)
            for name, _, module, _ in unplanned
        ):
            continue  # held by a container only (RoBERTa's lm_head.bias, tied to lm_head.decoder.bias): it follows
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
