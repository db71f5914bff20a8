"""Finding the local view an attention module needs (`local_view`) by simulating the ranks on the one module, in one
process: the first candidate under which the ranks' row inputs and outputs match the unsharded module's is taken."""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from functools import partial
from itertools import combinations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tp_train.errors import first_line
from tp_train.parallel.sharding import ShardSpec, join_shards, shard_parameter
from tp_train.plan.channels import local_channels
from tp_train.plan.compare import detached, first_tensor, relative_difference
from tp_train.plan.local_view import (
    INPUT_WIDTH,
    LocalView,
    PerHeadArgument,
    apply_local_view,
    share_replicated_kv_heads,
    usual_fields,
)
from tp_train.plan.probe import forward_without_cache, hooks_removed, tensor_caches
from tp_train.plan.probe_input import ProbeInput
from tp_train.plan.styles import head_counts, linear_shape, parameter_shard_spec, split_style, style_shard_spec

MOST_CHANGES = 4  # largest set of changes tried at once
MOST_CANDIDATES = 12  # candidates considered, most likely first
TOLERANCE = 1e-4  # relative to the largest reference value
HEADISH = ("head", "group", "embd", "embed", "hidden", "width", "dim", "size", "kv")


@dataclass
class ProbeCall:
    args: tuple
    kwargs: dict

    def fresh(self) -> tuple[tuple, dict]:
        """A copy of the arguments for one run: a key/value cache among them fills up as the module runs."""
        return copy.deepcopy((self.args, self.kwargs))


def capture_calls(model: nn.Module, inputs: ProbeInput, names: set[str]) -> dict[str, ProbeCall]:
    """The (last) call of each named module in one forward of `model` on `inputs`: its arguments, detached."""
    calls: dict[str, ProbeCall] = {}
    modules = dict(model.named_modules())

    def record(name, module, args, kwargs):
        calls[name] = ProbeCall(*copy.deepcopy(detached((args, kwargs))))  # as it was then: a cache fills up

    handles = [modules[name].register_forward_pre_hook(partial(record, name), with_kwargs=True) for name in names]
    with hooks_removed(handles), torch.no_grad():
        forward_without_cache(model, inputs)
    return calls


def find_local_view(
    module: nn.Module,
    call: ProbeCall,
    columns: dict[str, str],
    row: str,
    tp: int,
    config=None,
    row_sections: tuple[int, ...] | None = None,
) -> tuple[str | None, str]:
    """The attention style (`attention` or `attention(...)`) under which `module` runs right on local heads at `tp`, or
    None and why not; `call` is its probe call, `columns` its column layers and styles, `row` its row layer."""
    reference = _Recorded.run(module, row, call)
    if reference.error is not None:
        return None, f"it does not run on the probe call ({reference.error})"
    first_failure = None
    ranks = _Ranks(module, columns, row, tp, config, reference)
    for view in _candidates(module, call, columns, row, tp):
        failure = _simulate(ranks, call, view, reference, row_sections)
        if failure is None:
            return ("attention" if view is None else view.style()), ""
        first_failure = first_failure or failure
    return None, f"no view of its head counts makes it run on local heads ({first_failure})"


class _RowStandIn(nn.Module):
    """The row layer in a rank's copy: records its (local) input at each call, returns the unsharded row layer's
    output at that call."""

    def __init__(self, outputs: list[torch.Tensor]):
        super().__init__()
        self.outputs, self.inputs = outputs, []

    def forward(self, x):
        self.inputs.append(x)
        return self.outputs[min(len(self.inputs), len(self.outputs)) - 1]


class _LocalLayer(nn.Module):
    """A rank's shard of a Linear (`function`: `F.linear`) or of an embedding table (`F.embedding`, no bias)."""

    def __init__(self, function, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.function, self.weight, self.bias = function, weight, bias

    def forward(self, x):
        return self.function(x, self.weight, self.bias)


@dataclass
class _Recorded:
    output: torch.Tensor | None = None
    row_inputs: list[torch.Tensor] = field(default_factory=list)  # at each call of the row layer
    row_outputs: list[torch.Tensor] = field(default_factory=list)
    error: str | None = None

    @staticmethod
    def run(module: nn.Module, row: str, call: ProbeCall) -> _Recorded:
        recorded = _Recorded()

        def hook(_, args, output):
            recorded.row_inputs.append(args[0].detach())
            recorded.row_outputs.append(output.detach())

        try:
            with module.get_submodule(row).register_forward_hook(hook), torch.no_grad():
                args, kwargs = call.fresh()
                recorded.output = first_tensor(module(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - reported as the reason
            recorded.error = first_line(error)
        return recorded


class _Ranks:
    """Builds each simulated rank's copy of the attention module: its column layers split as `apply_plan` splits
    them (the same `ShardSpec`s, from their styles, arguments and head counts, so kv heads fewer than ranks are
    replicated), its per-head embedding tables as their parameter entries split them, its per-channel modules as
    `channelwise` splits them, and, where they are, its kv heads made one per rank as `apply_plan` makes them."""

    def __init__(self, module: nn.Module, columns: dict[str, str], row: str, tp: int, config, reference: _Recorded):
        self.module, self.row, self.tp, self.reference = module, row, tp, reference
        self.own, self.layers, self.replicated, self.channels = {}, {}, {}, {}
        for name, style in columns.items():
            holder, attribute = _holder(module, name)
            if attribute in holder._parameters or attribute in holder._buffers:
                # a per-channel parameter inside the attention (DeBERTa's q_bias), or buffer (a BatchNorm's statistics)
                spec = parameter_shard_spec(style, holder, attribute)
                if spec is not None:  # one held whole (its gradient summed) runs as it is
                    self.own[name] = spec
                continue
            child = module.get_submodule(name)
            if isinstance(child, nn.Embedding):  # a per-head table (T5's relative position bias)
                self.layers[name] = (F.embedding, parameter_shard_spec(style, child, "weight"), None)
                continue
            base, arguments = split_style(style)
            if base == "channelwise":  # per-channel parameters between the layers (Inkling's short convolutions)
                self.channels[name] = arguments
                continue
            parent = name.rpartition(".")[0]
            counts = head_counts(module.get_submodule(parent), config)
            spec = style_shard_spec(base, child, "weight", counts, arguments)
            self.layers[name] = (F.linear, spec, style_shard_spec(base, child, "bias", counts, arguments))
            copies = max(spec.replicas(tp))
            if copies > 1:
                self.replicated[parent] = copies

    def copy(self, rank: int) -> tuple[nn.Module, _RowStandIn]:
        memo = {id(cache): {} for cache in tensor_caches(self.module)}  # whole values: computed again on shards
        for name, (function, spec, bias_spec) in self.layers.items():
            child = self.module.get_submodule(name)
            tensors = [(child.weight, spec), (getattr(child, "bias", None), bias_spec)]
            shards = [shard_parameter(tensor, split, rank, self.tp) for tensor, split in tensors if tensor is not None]
            memo[id(child)] = _LocalLayer(function, *shards)
        stand_in = _RowStandIn(self.reference.row_outputs)
        memo[id(self.module.get_submodule(self.row))] = stand_in
        local = copy.deepcopy(self.module, memo)
        for name, arguments in self.channels.items():
            local_channels(local.get_submodule(name), rank, self.tp, arguments)
        for name, spec in self.own.items():
            shard = shard_parameter(getattr(*_holder(self.module, name)), spec, rank, self.tp)
            holder, attribute = _holder(local, name)
            if attribute in holder._buffers:
                holder._buffers[attribute] = shard
            else:
                holder._parameters[attribute] = nn.Parameter(shard)
        return local, stand_in

    def localize(self, local: nn.Module, view: LocalView | None, rank: int) -> None:
        """`view` on a rank's copy, then its replicated kv heads, in `apply_plan`'s order."""
        apply_local_view(local, view, self.tp, rank)
        for parent, copies in self.replicated.items():
            share_replicated_kv_heads(local.get_submodule(parent), copies)


def _holder(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The module holding `name` (a submodule's or a parameter's dotted name under `module`), and its last part."""
    parent, _, attribute = name.rpartition(".")
    return module.get_submodule(parent), attribute


def _simulate(
    ranks: _Ranks, call: ProbeCall, view: LocalView | None, reference: _Recorded, row_sections=None
) -> str | None:
    """None when `view` makes every simulated rank right; else what went wrong. The ranks' row inputs are put
    together section by section (`row_sections`, default one), each rank's chunk of each in turn."""
    row_inputs = []
    for rank in range(ranks.tp):
        local, stand_in = ranks.copy(rank)
        try:
            ranks.localize(local, view, rank)
            with torch.no_grad():
                args, kwargs = call.fresh()
                output = first_tensor(local(*args, **kwargs))
        except Exception as error:  # noqa: BLE001 - a view under which the forward fails is a wrong view
            return f"on local heads its forward fails: {first_line(error)}"
        if len(stand_in.inputs) != len(reference.row_inputs):
            return "its row layer is not reached as often as in the unsharded module"
        alike = output is not None and output.shape == reference.output.shape  # relative_difference ignores shapes
        if not alike or relative_difference(output, reference.output) > TOLERANCE:
            return "on local heads its output differs from the unsharded module's"
        row_inputs.append(stand_in.inputs)
    for index, expected in enumerate(reference.row_inputs):  # at each call of the row layer
        try:
            side_by_side = _side_by_side([inputs[index] for inputs in row_inputs], row_sections)
        except RuntimeError as error:
            return f"its row layer's local inputs do not line up ({first_line(error)})"
        mismatched = side_by_side.shape != expected.shape  # relative_difference does not compare shapes
        if mismatched or relative_difference(side_by_side, expected) > TOLERANCE:
            return "on local heads its row layer's input differs from the unsharded module's"
    return None


def _side_by_side(local: list[torch.Tensor], sections: tuple[int, ...] | None) -> torch.Tensor:
    """The full row input from the ranks' `local` ones: rank by rank within each of its `sections` in turn."""
    width = sum(x.shape[-1] for x in local)
    return join_shards(local, ShardSpec(dim=local[0].dim() - 1, sections=tuple(sections or (width,))))


def _candidates(module: nn.Module, call: ProbeCall, columns, row, tp: int):
    yield None  # plain `attention`
    # the usual head-count names, the module's own first, then those of modules inside it (Inkling 2's short
    # convolutions, which view their input by their own `num_heads`)
    usual = {*usual_fields(module), *(f"{name}.{field}" for name, inner in module.named_modules() if name
                                      for field in usual_fields(inner))}  # fmt: skip
    fields = [path for path in _count_fields(module, {*columns, row}, tp)]
    fields.sort(key=lambda path: (path not in usual, not any(word in path.lower() for word in HEADISH)))
    bound = inspect.signature(type(module).forward).bind(module, *call.args, **call.kwargs).arguments
    names = list(bound)[1:]
    first = bound[names[0]] if names else None
    toggles: list = fields[: MOST_CANDIDATES - 1]
    width = isinstance(first, torch.Tensor) and first.dim() and first.shape[-1] % tp == 0
    if width:
        toggles.insert(min(len(toggles), 3), INPUT_WIDTH)
    batch = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else 1
    for name in names[1:]:
        value = bound[name]
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dim() < 2:
            continue
        if isinstance(first, torch.Tensor) and value.shape == first.shape:
            continue  # a residual, not a per-head tensor
        for dim in (0, 1):
            size = value.shape[dim]
            if size > 1 and size % tp == 0:
                toggles.append(PerHeadArgument(name, dim, False))
            if dim == 0 and batch > 1 and size % (batch * tp) == 0 and size > batch:
                toggles.append(PerHeadArgument(name, dim, True))
    toggles = toggles[:MOST_CANDIDATES]
    # `local_reshapes` last, once every view without it has failed: it only mends reshapes that would raise, so a
    # view that needs no mending (Longformer's input_width) is the one a plan names
    for reshapes, first_count in ((False, 1), (True, 0)) if width else ((False, 1),):
        for count in range(first_count, MOST_CHANGES + 1 - reshapes):
            for chosen in combinations(toggles, count):
                per_head = tuple(item for item in chosen if isinstance(item, PerHeadArgument))
                if len({item.name for item in per_head}) < len(per_head):
                    continue
                yield LocalView(
                    fields=tuple(item for item in chosen if isinstance(item, str) and item != INPUT_WIDTH),
                    input_width=INPUT_WIDTH in chosen,
                    per_head=per_head,
                    local_reshapes=reshapes,
                )


def _count_fields(module: nn.Module, planned: set[str], tp: int) -> list[str]:
    """Dotted paths of the integers a view could divide: the module's own attributes, the fields of objects it
    holds (a config), and the attributes and dict entries of its parameterless submodules (einops' layers)."""
    paths = []

    def add_counts(prefix: str, namespace: dict):
        for key, value in namespace.items():
            if not isinstance(key, str) or key.startswith("_"):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= tp and value % tp == 0:
                paths.append(prefix + key)
            elif isinstance(value, dict) and prefix.count(".") < 2:
                add_counts(f"{prefix}{key}.", value)

    add_counts("", vars(module))
    for key, value in vars(module).items():  # objects holding fields (a config), not modules, tensors or plain values
        plain = isinstance(value, (nn.Module, torch.Tensor, type, int, float, str, bytes, tuple, list, dict))
        if not key.startswith("_") and hasattr(value, "__dict__") and not plain and not callable(value):
            add_counts(f"{key}.", vars(value))
    for name, child in module.named_modules():
        # parameterless layers (einops'), and inner attention modules holding parameters of their own beside their
        # layers (DeBERTa's self-attention, with its q_bias); not leaf layers with weights (embeddings), but those
        # whose weights are split with the heads (xLSTM's per-head norm, which checks its input's head count)
        inner = not any(True for _ in child.parameters(recurse=False)) or any(True for _ in child.children())
        inner = inner or any(f"{name}.{param}" in planned for param in child._parameters)
        if name and name not in planned and inner and linear_shape(child) is None:
            add_counts(f"{name}.", {k: v for k, v in vars(child).items() if k != "training"})
    return paths
