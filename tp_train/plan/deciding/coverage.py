"""How much of a model an inferred plan covers, and how its names read: the parameters a plan splits, the note
printed for each attention kept whole, and module names folded into `*` patterns (`tp_train.plan.deciding.autoplan`)."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.styles import (
    FEATURE_REDUCTION_STYLE,
    LINEAR_STYLES,
    NORM_STYLES,
    linear_shape,
    pattern_matches,
    split_style,
)


def sharded_parameters(model: nn.Module, plan: dict[str, str]) -> set[int]:
    """The ids of the parameters `plan` splits: those of modules it swaps or splits by channel, and those it names."""
    splitting = {"embedding_rowwise", "channelwise", FEATURE_REDUCTION_STYLE, *NORM_STYLES, *LINEAR_STYLES}
    found = set()
    for name, module in model.named_modules():
        if any(split_style(style)[0] in splitting for pattern, style in plan.items() if pattern_matches(pattern, name)):
            found |= {id(param) for param in module.parameters()}
    for name, param in model.named_parameters():
        if any(style != "replicate" and pattern_matches(pattern, name) for pattern, style in plan.items()):
            found.add(id(param))
    return found


def covered_linears(model: nn.Module, plan: dict[str, str]) -> set[str]:
    """The Linears `plan` says something about: named by an entry (any style), or inside a module it keeps whole
    (`replicate`): the auto-planner, completing a plan, pairs only the others."""
    whole = [name for name, _ in model.named_modules() if any(
        style == "replicate" and pattern_matches(pattern, name) for pattern, style in plan.items())]  # fmt: skip
    return {
        name
        for name, module in model.named_modules()
        if linear_shape(module) is not None
        and (any(pattern_matches(pattern, name) for pattern in plan) or any(name.startswith(w + ".") for w in whole))
    }


SMALL_WHOLE = 0.1  # a block Linear no plan entry shards may stay whole up to this fraction of its block's parameters


def whole_beyond_small(model: nn.Module, name: str, plan: dict[str, str], sharded: set[int] | None = None) -> float:
    """The fraction of the parameters of the repeated block (`layers.3`) holding module `name` that `plan` leaves
    whole on every rank (`sharded`: `sharded_parameters(model, plan)`, when known) when it is more than `SMALL_WHOLE`
    (an MoE router beside experts the plan shards may stay whole), else 0: the one test of that threshold, for the
    auto-planner's refusal and for completing a model's own plan."""
    block = model.get_submodule(block_of(name))
    sharded = sharded_parameters(model, plan) if sharded is None else sharded
    params = list(block.parameters())
    fraction = sum(p.numel() for p in params if id(p) not in sharded) / max(sum(p.numel() for p in params), 1)
    return fraction if fraction > SMALL_WHOLE else 0.0


def kept_whole_notes(model: nn.Module, styles: dict[str, str], kept_whole: dict[str, str]) -> list[str]:
    """One line per attention pattern kept whole: the module, why, and the fraction of parameters sharded."""
    if not kept_whole:
        return []
    sharded = sharded_parameters(model, styles)
    params = list(model.parameters())
    fraction = sum(param.numel() for param in params if id(param) in sharded) / max(sum(p.numel() for p in params), 1)
    by_pattern = {}
    for name, reason in kept_whole.items():
        by_pattern.setdefault(generic(name), reason)
    return [
        f"note: attention '{pattern}' kept whole on every rank: {reason}; {fraction:.0%} of the parameters are sharded"
        for pattern, reason in by_pattern.items()
    ]


def generic(name: str) -> str:
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def in_repeated_block(name: str) -> bool:
    return any(part.isdigit() for part in name.split("."))


def block_of(name: str) -> str:
    """The repeated block holding module `name`: its name up to the first numbered part (`layers.3`)."""
    parts = name.split(".")
    return ".".join(parts[: next((i for i, part in enumerate(parts) if part.isdigit()), len(parts)) + 1])


def in_block(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` lies inside a repeated block: under a numbered module (`layers.3`) that holds modules
    of its own. A model-level list of bare projections (Gemma 3n's `altup_projections.0`, each applied once to the
    embeddings, outside every block) is not a block, though its names hold an index."""
    module = name.rpartition(".")[0]
    return in_repeated_block(module) and any(True for _ in model.get_submodule(block_of(module)).children())


def as_patterns(model: nn.Module, styles: dict[str, str]) -> dict[str, str]:
    """`styles` (of modules, and of parameters and buffers: a per-head table's weight) with numbered names folded
    into `*` patterns wherever every name a pattern matches has the same style; in the order of `named_modules`."""
    names = [name for name, _ in model.named_modules() if name]
    # every parameter or buffer a pattern of a planned one could match, planned or not (a kept-whole attention's)
    planned = {generic(name) for name in styles}
    names += [name for name, _ in [*model.named_parameters(), *model.named_buffers()] if generic(name) in planned]
    plan: dict[str, str] = {}
    for name in [name for name in names if name in styles]:
        pattern = generic(name)
        matched = [other for other in names if pattern_matches(pattern, other)]
        if all(styles.get(other) == styles[name] for other in matched):
            plan.setdefault(pattern, styles[name])
        else:
            plan[name] = styles[name]
    return plan
