"""Resolving a plan against a model: every module each entry names, with its style, validated before any weight
changes (`ValueError`, one line, naming the entry, the module and what would work)."""

from __future__ import annotations

import torch.nn as nn

from tp_train.parallel.sharding import check_divisible, divisors
from tp_train.plan.styles import (
    ALIASES,
    CONFIG_HEAD_FIELDS,
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    LINEAR_STYLES,
    PACKED_SECTIONS,
    STYLES,
    WIDTH_ATTRIBUTES,
    PlannedModule,
    linear_shape,
    pattern_matches,
    section_sizes,
    split_style,
)
from tp_train.plan.ties import tie_completions


def match_plan(model: nn.Module, plan: dict[str, str], tp: int) -> list[PlannedModule]:
    """Every module the plan names, with its style, after checking that the plan applies at this tp."""
    check_config_heads(model, tp)
    planned: dict[str, PlannedModule] = {}
    for pattern, style in plan.items():
        style, arguments = split_style(ALIASES.get(style, style))
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
            _check_module(name, module, style, pattern, tp, arguments)
            planned[name] = PlannedModule(name, module, style, pattern, arguments)
    for entry in tie_completions(model, planned):
        _check_module(entry.name, entry.module, entry.style, entry.pattern, tp)
        planned[entry.name] = entry
    order = {name: index for index, (name, _) in enumerate(model.named_modules())}
    return sorted(planned.values(), key=lambda entry: order[entry.name])


def check_config_heads(model: nn.Module, tp: int) -> None:
    config = getattr(model, "config", None)
    for field in CONFIG_HEAD_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and value % tp:
            replication = " (replicating kv heads is not supported)" if field in KV_HEAD_ATTRIBUTES else ""
            raise ValueError(
                f"config.{field}={value} is not divisible by tensor_parallel_size={tp}: each rank must hold whole "
                f"heads{replication}; use a tensor_parallel_size in {divisors(value)}"
            )


def _check_module(name: str, module: nn.Module, style: str, pattern: str, tp: int, arguments: str = "") -> None:
    where = f"plan entry '{pattern}': module '{name}' ({type(module).__name__})"
    if style in LINEAR_STYLES:
        shape = linear_shape(module)
        if shape is None:
            raise ValueError(f"{where} cannot take style '{style}': it needs an nn.Linear or a Conv1D")
        in_features, out_features = shape
        if style == "rowwise":
            check_divisible(where, "in_features", in_features, tp)
        elif section_sizes(arguments):
            sections = section_sizes(arguments)
            if sum(sections) != out_features:
                raise ValueError(f"{where}: sections {sections} do not add up to out_features={out_features}")
            for size in sections:
                check_divisible(where, "a section", size, tp)
        elif style in PACKED_SECTIONS:
            sections = PACKED_SECTIONS[style]
            if out_features % sections:
                raise ValueError(f"{where}: out_features={out_features} does not split into {sections} sections")
            check_divisible(where, f"out_features/{sections}", out_features // sections, tp)
        elif style == "colwise":
            check_divisible(where, "out_features", out_features, tp)
    elif style == "channelwise":
        for param_name, param in module.named_parameters(recurse=False):
            check_divisible(where, f"{param_name}.shape[0]", param.shape[0] if param.dim() else 1, tp)
    elif style == "embedding_rowwise":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{where} cannot take style '{style}': it needs an nn.Embedding")
        if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
            raise ValueError(f"{where}: max_norm, sparse and scale_grad_by_freq are not supported when sharded")
    elif style == "attention" and not arguments:
        for attribute in HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES + WIDTH_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int):
                check_divisible(where, attribute, value, tp)


def _example_names(model: nn.Module) -> str:
    names = [name for name, _ in model.named_modules() if name][:4]
    return ", ".join(f"'{name}'" for name in names) + ", ..."
