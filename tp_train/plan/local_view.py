"""Local views: how an attention module is made to run on one rank's heads when its head counts live where the
`attention` style's attribute list does not reach (docs/own-models.md, "Running on local heads")."""

from __future__ import annotations

import copy
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tp_train.parallel.reductions import run_forward_in_mode
from tp_train.parallel.sharding import ShardSpec, check_sections
from tp_train.plan.styles import (
    CONFIG_HEAD_FIELDS,
    HEAD_ATTRIBUTES,
    KV_GROUP_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    WIDTH_ATTRIBUTES,
    section_sizes,
    section_units,
)

INPUT_WIDTH = "input_width"
LOCAL_RESHAPES = "local_reshapes"
RESHAPES = (torch.Tensor.reshape, torch.Tensor.view, torch.reshape)


@dataclass(frozen=True)
class PerHeadArgument:
    name: str  # the forward's parameter name
    dim: int  # the dimension that holds the heads
    batch_major: bool  # the dimension is (batch, heads) folded into one

    def __str__(self) -> str:
        return f"{self.name}[{self.dim}{',batch' if self.batch_major else ''}]"


@dataclass(frozen=True)
class LocalView:
    fields: tuple[str, ...] = ()
    input_width: bool = False
    per_head: tuple[PerHeadArgument, ...] = ()
    local_reshapes: bool = False

    def style(self) -> str:
        flags = [INPUT_WIDTH] * self.input_width + [LOCAL_RESHAPES] * self.local_reshapes
        items = [*self.fields, *flags, *map(str, self.per_head)]
        return f"attention({', '.join(items)})"


def parse_attention_style(style: str) -> LocalView | None:
    """The view an `attention(...)` style names; None for plain `attention` (the usual attribute names)."""
    if style == "attention":
        return None
    if not (style.startswith("attention(") and style.endswith(")")):
        raise ValueError(f"'{style}' is not an attention style; write 'attention' or 'attention(n_head, ...)'")
    fields, width, per_head, reshapes = [], False, [], False
    for item in (part.strip() for part in style[len("attention(") : -1].split(", ")):
        if item == INPUT_WIDTH:
            width = True
        elif item == LOCAL_RESHAPES:
            reshapes = True
        elif item.endswith("]") and "[" in item:
            name, _, where = item[:-1].partition("[")
            dim, _, batch = where.partition(",")
            per_head.append(PerHeadArgument(name, int(dim), batch == "batch"))
        elif item:
            fields.append(item)
    return LocalView(tuple(fields), width, tuple(per_head), reshapes)


def usual_fields(module: nn.Module) -> tuple[str, ...]:
    """The module's own integer attributes with the usual head-count and width names (what plain `attention`
    divides)."""
    names = HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES + WIDTH_ATTRIBUTES
    return tuple(name for name in names if _is_count(getattr(module, name, None)))


def kept_heads(module: nn.Module) -> int | None:
    """The head count `module` keeps under a usual name, or the first module inside it does (Swin's self-attention)."""
    counts = (getattr(inner, name, None) for inner in module.modules() for name in HEAD_ATTRIBUTES)
    return next((count for count in counts if isinstance(count, int)), None)


def field_value(module: nn.Module, path: str):
    """The value at a dotted `path` under `module` (attributes, or keys of a dict on the way)."""
    value = module
    for part in path.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part, None)
    return value


def apply_local_view(module: nn.Module, view: LocalView | None, tp: int, rank: int) -> None:
    """Makes `module` run on this rank's `1/tp` of the heads, as `view` says (None: the usual attribute names and
    its config's head counts, `localize_heads`)."""
    if view is None:
        localize_heads(module, tp)
        return
    rebuilt: dict[int, nn.Module] = {}
    for path in view.fields:
        _divide_field(module, path, tp, rebuilt)
    for layer in list(rebuilt.values()):
        _rebuild_pattern_layer(module, layer)
    if view.local_reshapes:
        _install_local_reshapes(module, tp)
    if not (view.input_width or view.per_head):
        return
    signature = inspect.signature(type(module).forward)

    def local_inputs(mod, args, kwargs):
        bound = signature.bind(mod, *args, **kwargs)
        arguments = bound.arguments
        names = list(arguments)[1:]  # past `self`
        first = arguments[names[0]]
        batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
        if view.input_width and isinstance(first, torch.Tensor):
            arguments[names[0]] = LocalWidth.of(first, tp)
        for argument in view.per_head:
            value = arguments.get(argument.name)
            if isinstance(value, torch.Tensor):
                arguments[argument.name] = heads_of_rank(value, argument, batch, tp, rank)
        return bound.args[1:], bound.kwargs

    module.register_forward_pre_hook(local_inputs, with_kwargs=True)


def localize_heads(module: nn.Module, tp: int) -> None:
    """Plain `attention`: rewrites the module's head counts and head widths (the usual attribute names) to this
    rank's share. An attention that reads head counts from a config shared with the whole model (phi3's
    `self.config.num_attention_heads`) gets a copy of it, its own, with the local counts; the model's config is left
    as it was. Fewer kv heads than ranks leave one (replicated) kv head per rank."""
    for attribute in usual_fields(module):
        setattr(module, attribute, _local_count(attribute, getattr(module, attribute), tp))
    config = getattr(module, "config", None)
    counts = {field: value for field in CONFIG_HEAD_FIELDS if _is_count(value := getattr(config, field, None))}
    if counts:
        local = copy.copy(config)
        for field, value in counts.items():
            setattr(local, field, _local_count(field, value, tp))
        module.config = local


def share_replicated_kv_heads(attention: nn.Module, copies: int) -> None:
    """An attention whose kv heads are replicated over `copies` ranks each (fewer kv heads than ranks): one kv head
    per rank, and each rank's share of the query heads per kv head; in the attention and the modules inside it that
    keep the counts too (NeoMME's exclusive self-attention repeats the kv heads by its own `num_key_value_groups`)."""
    for module in attention.modules():
        for attribute in KV_HEAD_ATTRIBUTES:
            if _is_count(getattr(module, attribute, None)):
                setattr(module, attribute, 1)
        for attribute in KV_GROUP_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if _is_count(value):
                setattr(module, attribute, value // copies)


def heads_of_rank(tensor: torch.Tensor, argument: PerHeadArgument, batch: int, tp: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s heads of a per-head tensor (chunk r of the heads, as the column split gives q's heads)."""
    dim = argument.dim % tensor.dim()
    if argument.batch_major:
        folded = tensor.unflatten(dim, (batch, -1))  # (..., batch, heads, ...)
        return folded.chunk(tp, dim + 1)[rank].flatten(dim, dim + 1)
    return tensor.chunk(tp, dim)[rank]


class LocalWidth(torch.Tensor):
    """A tensor whose `size()` and `.shape` report `1/tp` of its last dimension; every operation runs on the whole
    tensor and returns plain tensors (autograd flows through as usual), but a transpose of two other dimensions,
    which keeps the features last, is a `LocalWidth` again (Longformer's time-major `hidden_states.transpose(0, 1)`
    before it reads its width)."""

    tp: int = 1

    @staticmethod
    def of(tensor: torch.Tensor, tp: int) -> LocalWidth:
        view = tensor.as_subclass(LocalWidth)
        view.tp = tp
        return view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.size, torch.Tensor.shape.__get__) and isinstance(args[0], LocalWidth):
            view = args[0]
            with torch._C.DisableTorchFunctionSubclass():
                shape = list(view.shape)
            shape[-1] //= view.tp
            if func is torch.Tensor.size and (len(args) > 1 or "dim" in kwargs):
                return shape[args[1] if len(args) > 1 else kwargs["dim"]]
            return torch.Size(shape)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        if func in (torch.Tensor.transpose, torch.transpose) and isinstance(args[0], LocalWidth):
            last = args[0].dim() - 1
            dims = [
                kwargs.get(name, args[i + 1] if len(args) > i + 1 else None) for i, name in enumerate(("dim0", "dim1"))
            ]
            if all(isinstance(dim, int) and dim % args[0].dim() != last for dim in dims):
                return LocalWidth.of(result, args[0].tp)
        return result


class _LocalReshapes(TorchFunctionMode):
    """Gives a reshape to a shape naming `width` that cannot hold its tensor `width / tp` instead (at the last place
    it names it), where that holds the tensor; every other call runs as it is."""

    def __init__(self, width: int, tp: int):
        super().__init__()
        self.width, self.tp = width, tp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in RESHAPES and len(args) > 1 and isinstance(args[0], torch.Tensor) and not kwargs:
            x, shape = args[0], args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
            shape = list(shape) if all(isinstance(size, int) for size in shape) else None
            if shape and self.width in shape and -1 not in shape and math.prod(shape) != x.numel():
                where = len(shape) - 1 - shape[::-1].index(self.width)
                shape[where] = self.width // self.tp
                if math.prod(shape) == x.numel():
                    return func(x, tuple(shape))
        return func(*args, **kwargs)


def _install_local_reshapes(module: nn.Module, tp: int) -> None:
    """Runs `module`'s forward under `_LocalReshapes` for the width of its first input."""

    def reshapes(args, kwargs) -> _LocalReshapes | None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        if not (isinstance(first, torch.Tensor) and first.dim()):
            return None
        with torch._C.DisableTorchFunctionSubclass():
            width = first.shape[-1]
        return _LocalReshapes(width, tp)

    run_forward_in_mode(module, reshapes)


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _local_count(attribute: str, value: int, tp: int) -> int:
    """A head count (or width) on one rank: its share, or one replicated kv head when there are fewer than tp."""
    return max(value // tp, 1) if attribute in KV_HEAD_ATTRIBUTES else value // tp


def field_and_sections(item: str) -> tuple[str, str]:
    """A view's field item split into its dotted path and the sections its parentheses name (`""` without)."""
    path, paren, rest = item.partition("(")
    return path, rest[:-1] if paren else ""


def local_field_value(value, sections: str, tp: int) -> int | None:
    """What a field holding `value` is on one rank: `value / tp`, or its share of the `sections` it is made of;
    None where that is no whole count (tp does not divide it, or the sections do not add up to it or cannot split)."""
    if not _is_count(value):
        return None
    if not sections:
        return None if value % tp else value // tp
    sizes, units = section_sizes(sections), section_units(sections)
    try:
        check_sections("local view", "field", sizes, units, tp, stored=False)
    except ValueError:
        return None
    spec = ShardSpec(dim=0, sections=sizes, units=units)
    return sum(spec.local_sections(tp)) if sum(sizes) == value else None


def _divide_field(module: nn.Module, item: str, tp: int, rebuilt: dict[int, nn.Module]) -> None:
    """Divides the integer at the item's path by tp (or sets its share of the sections the item names) in `module`'s
    own view: objects on the way that are not submodules (configs, dicts) are replaced by copies on their holder
    first, so what other modules share stays global."""
    path, sections = field_and_sections(item)
    holder, parts = module, path.split(".")
    for part in parts[:-1]:
        value = holder[part] if isinstance(holder, dict) else getattr(holder, part)
        if isinstance(value, nn.Module):
            if isinstance(holder, nn.Module) and _builds_from_pattern(value):
                rebuilt[id(value)] = value
            holder = value
            continue
        local = copy.copy(value)  # the module's own view of a shared object (each path copies once: see below)
        if not getattr(value, "_tp_local_view", False):
            try:
                object.__setattr__(local, "_tp_local_view", True)
            except (AttributeError, TypeError):
                pass  # dicts: a fresh copy per path is harmless, they are tiny
            _set(holder, part, local)
            value = local
        holder = value
    last = parts[-1]
    value = holder[last] if isinstance(holder, dict) else getattr(holder, last)
    replicated = not sections and last in KV_HEAD_ATTRIBUTES and _is_count(value) and value and not tp % value
    local = _local_count(last, value, tp) if replicated else local_field_value(value, sections, tp)  # as `attention`
    if local is None:
        raise ValueError(f"local view: '{item}' of {type(module).__name__} is {value!r}, not a count tp={tp} divides")
    _set(holder, last, local)


def _set(holder, key: str, value) -> None:
    if isinstance(holder, dict):
        holder[key] = value
        return
    try:
        setattr(holder, key, value)  # through the holder's own __setattr__ (a config's attribute map)
    except (AttributeError, TypeError):  # a frozen dataclass: its copy is ours to change
        object.__setattr__(holder, key, value)


def _builds_from_pattern(layer: nn.Module) -> bool:
    """A parameterless layer built from a pattern and axis lengths (einops' layers), which it parses when built."""
    return (
        isinstance(getattr(layer, "pattern", None), str)
        and isinstance(getattr(layer, "axes_lengths", None), dict)
        and not any(True for _ in layer.parameters())
    )


def _rebuild_pattern_layer(module: nn.Module, layer: nn.Module) -> None:
    extra = (layer.reduction,) if isinstance(getattr(layer, "reduction", None), str) else ()
    fresh = type(layer)(layer.pattern, *extra, **layer.axes_lengths)
    for name, child in module.named_modules():
        if child is layer and name:
            parent_name, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent_name) if parent_name else module, attribute, fresh)
