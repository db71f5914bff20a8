"""Shared parameters under a plan: a parameter two modules hold (a tied embedding and head) must be split alike
on both, or on neither; sharding one side would silently untie them."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.styles import LINEAR_STYLES, PlannedModule, linear_shape

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
