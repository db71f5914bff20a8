"""Head counts read off an attention's own reshape (`view(..., heads, head_dim)`), for grouped-query attention whose
counts no config states; the config is the cross-check (docs/planner.md, "Kv heads fewer than ranks")."""

from __future__ import annotations

import contextlib
from functools import partial

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tp_train.plan.probe import eval_mode, forward_without_cache, hooks_removed, probe_copy
from tp_train.plan.probe_input import probe_input
from tp_train.plan.styles import HeadCounts, head_counts, linear_shape

SPLITS = (torch.Tensor.reshape, torch.Tensor.view, torch.reshape, torch.Tensor.unflatten, torch.unflatten)


def grouped_without_counts(model: nn.Module, columns: list[str]) -> list[str]:
    """The attention modules (`attention_of`) of plain column layers `columns` that hold layers of unequal widths (query
    and narrower kv projections) whose head counts, read from the module or the model's config, do not explain the
    narrower ones (no kv head count, or one that gives other widths)."""
    config = getattr(model, "config", None)
    shapes = {name: linear_shape(model.get_submodule(name)) for name in columns}
    found = []
    for parent, layers in _by_attention({name: shape[1] for name, shape in shapes.items() if shape}).items():
        if len(set(layers.values())) < 2:
            continue
        counts = head_counts(model.get_submodule(parent) if parent else model, config)
        if not (counts.kv_heads and counts.head_dim and counts.kv_heads * counts.head_dim == min(layers.values())):
            found.append(parent)  # the narrowest layer's width is not the kv heads' the counts give
    return found


def observed_counts(model: nn.Module, columns: list[str], example_input=None) -> dict[str, HeadCounts]:
    """The head counts of each of `columns` (plain column layers) whose attention splits their outputs into heads
    of one width with fewer kv heads than query heads, as one probe forward shows them; {} where the probe does not
    run (the planner then reads counts as before, and verification checks the result)."""
    on_meta = any(param.is_meta for param in model.parameters())  # shapes alone: no materialised copy of a big model
    try:
        with (
            contextlib.nullcontext(model) if on_meta else probe_copy(model) as probe,
            eval_mode(probe),
            torch.no_grad(),
        ):
            inputs, mode = probe_input(probe, example_input), _Splits()
            watch = [probe.get_submodule(name).register_forward_hook(partial(_watch, mode, name)) for name in columns]
            with hooks_removed(watch), mode:
                forward_without_cache(probe, inputs)
    except Exception:  # noqa: BLE001 - no observation: the counts stay as the module and config state them
        return {}
    counts = {}
    for layers in _by_attention(mode.found).values():
        for head_dim in {dim for _, dim in layers.values()}:
            same = {name: heads for name, (heads, dim) in layers.items() if dim == head_dim}
            most, fewest = max(same.values()), min(same.values())
            if fewest < most:
                counts.update(dict.fromkeys(same, HeadCounts(most, fewest, head_dim)))
    return counts


def attention_of(name: str, names) -> str:
    """The module holding layer `name` and another of `names` (its attention), the innermost such: its parent, or
    further up where each projection has a wrapper of its own (Moshi's `k_proj.linear`); its parent where none."""
    parent = name.rpartition(".")[0]
    while parent:
        if any(other != name and other.startswith(parent + ".") for other in names):
            return parent
        parent = parent.rpartition(".")[0]
    return name.rpartition(".")[0]


def _by_attention(values: dict) -> dict[str, dict]:
    grouped: dict[str, dict] = {}
    for name, value in values.items():
        grouped.setdefault(attention_of(name, values), {})[name] = value
    return grouped


class _Splits(TorchFunctionMode):
    """Records, per watched tensor, the first reshape that splits its last dim into (heads, head_dim); results of
    same-shaped operations on a watched tensor (a bias add, `.contiguous()`) are watched too."""

    def __init__(self):
        super().__init__()
        self.watched: dict[int, tuple[str, torch.Tensor]] = {}  # id -> (layer, tensor kept alive)
        self.found: dict[str, tuple[int, int]] = {}

    def watch(self, name: str, tensor) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.dim():
            self.watched[id(tensor)] = (name, tensor)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        entry = self.watched.get(id(source)) if source is not None else None
        if entry is None or entry[1] is not source or not isinstance(result, torch.Tensor):
            return result
        name, width = entry[0], source.shape[-1]
        if func in SPLITS and result.dim() > source.dim() and result.numel() == source.numel():
            heads, head_dim = result.shape[-2], result.shape[-1]
            if heads * head_dim == width and head_dim != width and name not in self.found:
                self.found[name] = (heads, head_dim)
        elif result.shape == source.shape:
            self.watch(name, result)
        return result


def _watch(mode: _Splits, name: str, module: nn.Module, args, output) -> None:
    mode.watch(name, output)
