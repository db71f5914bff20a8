"""What a constructor does to its weights, recorded while it runs on the meta device and done again once they exist.

An eager build initialises a weight in several passes: its layer's `reset_parameters`, then whatever the model does
after (nanoGPT's `self.apply(self._init_weights)` and its scaled `c_proj` loop; Hugging Face's `post_init`, whose
rules run children first and parents last, so GPT-2's attention rescales its child `c_proj`, and Mamba's mixer copies
a time-step bias computed from a draw into its `dt_proj`; openai-gpt's `Conv1D` drawing its own weight in
`__init__`). On the meta device those writes do nothing. `InitRecorder` keeps, per tensor, every in-place write made to
it during `deferred_init` (the function and its arguments, in order), and, for a meta tensor an operation computed
(a draw, a product of draws), how to compute it again; `replay` makes the same writes on the real tensor, full size,
before its shard is taken. Each weight then starts from the distribution its eager build gives it, at every tp (every
rank replays the same whole tensor in the same order). torchdistx's deferred initialisation records whole
operation graphs the same way.

What is not replayed (the tensor's record ends with `UNKNOWN`, and `meta_init.materialize` runs its module's
initialiser instead): a write through a view of the tensor, and a write of a value read from another model tensor.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import wraps
from typing import Any

import torch
import torch.nn.init
from torch.utils._pytree import tree_leaves, tree_map

# Names ending in "_" that do not write a value.
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "retain_grad", "detach_", "resize_", "set_", "pin_memory_"})
INIT_RECORDS = "_tp_init_records"  # a module's attribute: its tensors' names -> the writes recorded on them
RECIPE = "_tp_recipe"  # a computed meta tensor's attribute: (func, args, kwargs, output index or None)
UNKNOWN = None  # in a record: a write of a value that cannot be computed again (replay stops being possible)
# torch.nn.init's functions that return at once for a meta tensor, without a write the recorder could see (torch's
# trunc_normal_ through its module-level helper, which also catches `from torch.nn.init import trunc_normal_`).
SKIPPED_ON_META = ("dirac_", "orthogonal_", "sparse_", "trunc_normal_", "_no_grad_trunc_normal_")
# Writes that set every element whatever the tensor held: a record must start with one (a `mul_` or `p[i] = 0` first
# would be made on `torch.empty`'s memory).
WHOLE_WRITES = frozenset({
    "normal_", "uniform_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "_no_grad_trunc_normal_", "orthogonal_", "sparse_", "dirac_", "constant_", "ones_", "zeros_",
    "eye_",
})  # fmt: skip


class _Target:
    """Stands in a recorded write's arguments for the tensor written to."""

    def __repr__(self) -> str:
        return "<target>"

    def __deepcopy__(self, memo) -> _Target:  # a copied model's records (the planner's probe) name the same target
        return self


TARGET = _Target()


@dataclass(frozen=True)
class _Value:
    """A computed meta tensor read by a recorded operation, as it was then: its recipe, then its first `writes`."""

    tensor: torch.Tensor
    writes: int

    def __deepcopy__(self, memo) -> _Value:  # the recipe it names is read, never written: shared by a copied model
        return self


def written_tensor(func, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor `func(*args, **kwargs)` writes in place (`Tensor.normal_`, `nn.init.kaiming_uniform_`, `p /= 2`,
    `p[1:] = 0`), or None."""
    name = getattr(func, "__name__", "")
    if name == "__setitem__" or name.endswith("_") and not name.startswith("_") and name not in _NOT_WRITES:
        target = args[0] if args else kwargs.get("tensor")
        return target if isinstance(target, torch.Tensor) else None
    return None


class InitRecorder:
    """The writes made to meta tensors, by tensor; a write through `.data` counts for the tensor it aliases."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[torch.Tensor, list]] = {}  # id -> (the tensor, kept alive; its writes)

    def record_of(self, tensor: torch.Tensor) -> list:
        """The list of writes to `tensor`, the same list for every alias of it."""
        entry = self._records.get(id(tensor))
        if entry is None:
            entry = self._records[id(tensor)] = (tensor, [])
            tensor._tp_writes = entry[1]  # where `replay` finds a computed tensor's writes
        return entry[1]

    def alias(self, original: torch.Tensor, alias: Any) -> None:
        """`alias` (what `original.data` returned) writes into `original`'s record."""
        if isinstance(alias, torch.Tensor) and alias is not original:
            self._records[id(alias)] = (alias, self.record_of(original))
            alias._tp_writes = self.record_of(original)

    def record(self, func, args: tuple, kwargs: dict, target: torch.Tensor) -> None:
        """Keeps the write `func(*args, **kwargs)` to the meta tensor `target`: replayable when every other meta tensor
        it reads was computed during the build (a draw, a product of draws), else `UNKNOWN`. A write through a view
        (torch's `orthogonal_` copies into `tensor.view_as(q)`) is not replayed: the viewed tensor's record ends."""
        if target._base is not None:
            self.record_of(target._base).append(UNKNOWN)
            return
        writes = self.record_of(target)
        if writes and writes[-1] is UNKNOWN:
            return
        recorded = self._arguments((args, kwargs), target)
        writes.append(UNKNOWN if recorded is None else (func, *recorded))

    def computed(self, func, args: tuple, kwargs: dict, result: Any) -> None:
        """Notes on each meta tensor `func` returned how to compute it again, where it can be."""
        several = isinstance(result, (tuple, list))
        outputs = result if several else (result,)
        meta = [output for output in outputs if isinstance(output, torch.Tensor) and output.is_meta]
        if not meta:
            return
        recorded = self._arguments((args, kwargs), None)
        if recorded is None:
            return
        inputs = {id(leaf) for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)}
        for index, output in enumerate(outputs):
            if isinstance(output, torch.Tensor) and output.is_meta and id(output) not in inputs:
                setattr(output, RECIPE, (func, *recorded, index if several else None))

    def _arguments(self, arguments: tuple, target: torch.Tensor | None):
        """`arguments` with `target` as `TARGET` and each computed meta tensor as a `_Value`; None where one is a
        meta tensor that cannot be computed again (a model tensor other than the target)."""
        unknown = False

        def placed(leaf):
            nonlocal unknown
            if not isinstance(leaf, torch.Tensor):
                return leaf
            if leaf is target:
                return TARGET
            if not leaf.is_meta:
                return leaf
            writes = self.record_of(leaf)
            if hasattr(leaf, RECIPE) and UNKNOWN not in writes:
                return _Value(leaf, len(writes))
            unknown = True
            return leaf

        arguments = tree_map(placed, arguments)
        return None if unknown else arguments


def computed_value(tensor: torch.Tensor) -> _Value:
    """A computed meta tensor as a value a recorded write reads (with the writes made to it so far)."""
    return _Value(tensor, len(getattr(tensor, "_tp_writes", ())))


def replayable(writes: list | None) -> bool:
    """Whether `writes` can be made again and give the tensor its whole value: the first sets every element, and none
    is of a value that could not be computed."""
    if not writes or UNKNOWN in writes:
        return False
    return getattr(writes[0][0], "__name__", "") in WHOLE_WRITES


def replay(writes: list, tensor: torch.Tensor, computed: dict) -> None:
    """Makes `writes` (recorded on the meta tensor `tensor` replaces) again on `tensor`, in order; the values they
    read are computed again on its device, once each per `computed` (one dict for one model's materialisation: a
    copy of the model, the planner's probe, has its own, so every rank draws the same values)."""
    with torch.no_grad():
        for func, args, kwargs in writes:
            args, kwargs = _placed((args, kwargs), tensor, computed)
            func(*args, **kwargs)


def _placed(arguments, tensor: torch.Tensor, computed: dict):
    def place(leaf):
        if leaf is TARGET:
            return tensor
        if isinstance(leaf, _Value):
            return _value(leaf, tensor.device, computed)
        return leaf.to(tensor.device) if isinstance(leaf, torch.Tensor) else leaf

    return tree_map(place, arguments, is_leaf=lambda leaf: isinstance(leaf, _Value))


def _value(value: _Value, device: torch.device, computed: dict) -> torch.Tensor:
    """The computed tensor `value` names, on `device`: its recipe run once per `computed` (a draw drawn once, whoever
    reads it, as in the eager build), then its first `value.writes` writes made on a copy."""
    key = (value.tensor, str(device), value.writes)  # the meta tensor itself: kept alive while its value is
    if key in computed:
        return computed[key]
    base = computed.get((value.tensor, str(device), 0))
    if base is None:
        func, args, kwargs, index = getattr(value.tensor, RECIPE)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": device}
        args, kwargs = _placed((args, kwargs), torch.empty(0, device=device), computed)
        base = func(*args, **kwargs)
        base = base[index] if index is not None else base
        if not isinstance(base, torch.Tensor) or base.is_meta:
            raise RuntimeError(f"deferred_init: {getattr(func, '__name__', func)} computed no real value on {device}")
        computed[(value.tensor, str(device), 0)] = base
    result = base.clone()
    for func, write_args, write_kwargs in value.tensor._tp_writes[: value.writes]:
        write_args, write_kwargs = _placed((write_args, write_kwargs), result, computed)
        func(*write_args, **write_kwargs)
    computed[key] = result
    return result


@contextmanager
def recording_skipped_inits(recorder: InitRecorder) -> Iterator[None]:
    """While building: a call to one of `SKIPPED_ON_META` on a meta tensor (`nn.init.orthogonal_` in a model's
    `__init__` or `_init_weights`; Hugging Face's initialisation calls torch's functions through its own table) is
    recorded as that tensor's write, to be made when it exists."""
    tables = [vars(torch.nn.init)]
    hugging_face = sys.modules.get("transformers.initialization")
    if hugging_face is not None and isinstance(getattr(hugging_face, "TORCH_INIT_FUNCTIONS", None), dict):
        tables.append(hugging_face.TORCH_INIT_FUNCTIONS)
    saved = [(table, name, table[name]) for table in tables for name in SKIPPED_ON_META if name in table]

    def recording(original):
        @wraps(original)
        def init(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                recorder.record(original, (tensor, *args), kwargs, tensor)
                return tensor
            return original(tensor, *args, **kwargs)

        return init

    for table, name, original in saved:
        table[name] = recording(original)
    try:
        yield
    finally:
        for table, name, original in saved:
            table[name] = original
