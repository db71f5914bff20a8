"""Where a planned model's transformer blocks (the elements of the `nn.ModuleList` holding the plan's parallel layers)
and output head (its `colwise_gather_output` layer) are, read off its matched plan."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tp_train.plan.styles import LINEAR_STYLES, PlannedModule


@dataclass
class BlockLayout:
    blocks: list[str]  # the repeated blocks, in order (the elements of one ModuleList)
    sub_blocks: set[str]  # modules inside a block that hold its parallel linears (attention, MLP): their interior
    # sees the whole sequence, between the column layers' all-gather and the row layers' reduce-scatter
    head: str | None  # the `colwise_gather_output` layer after the blocks (the LM head), if there is one
    planned: dict[str, str]  # module name -> style (with its arguments), for every planned module

    def in_blocks(self, name: str) -> bool:
        return any(name == block or name.startswith(block + ".") for block in self.blocks)


def block_layout(model: nn.Module, planned: list[PlannedModule], feature: str) -> BlockLayout:
    """The blocks, their sub-blocks and the head of `model` under its matched plan; `feature` names what needs them
    in the one-line `ValueError` raised when the model has no recognisable blocks."""
    linears = [entry.name for entry in planned if entry.style in LINEAR_STYLES]
    lists: dict[str, nn.ModuleList] = {}
    for name in linears:
        parts = name.split(".")
        for depth in range(1, len(parts)):
            parent = ".".join(parts[:depth])
            if isinstance(model.get_submodule(parent), nn.ModuleList):
                lists.setdefault(parent, model.get_submodule(parent))
                break
    if len(lists) != 1:
        found = f"{len(lists)} ({', '.join(sorted(lists))})" if lists else "none"
        raise ValueError(
            f"{feature} needs the transformer blocks in one nn.ModuleList holding the planned linear layers; "
            f"{type(model).__name__} has {found}: planned layers are {linears[:3]}..."
        )
    (list_name, blocks), *_ = lists.items()
    names = [f"{list_name}.{index}" for index in range(len(blocks))]
    styles = {entry.name: entry.written_style for entry in planned}
    layout = BlockLayout(names, set(), None, styles)
    for name in linears:
        parent = name.rpartition(".")[0]
        if layout.in_blocks(name) and parent not in layout.blocks:
            layout.sub_blocks.add(parent)
    heads = [e.name for e in planned if e.style == "colwise_gather_output" and not layout.in_blocks(e.name)]
    layout.head = heads[0] if len(heads) == 1 else None
    return layout


def blocks_if_any(model: nn.Module, planned: list[PlannedModule]) -> list[str]:
    """The transformer blocks' names, or none when the plan's layers are not in one ModuleList."""
    try:
        return block_layout(model, planned, "the blocks").blocks
    except ValueError:
        return []
