"""Per-module verification of the plan entries that swap no module: region styles (`moe_tp_experts`, `all_reduce`,
the parallel norms) and the parameters they shard in place, each run on its probe arguments before and after
sharding (docs/planner.md, "What a plan cannot get wrong silently")."""

from __future__ import annotations

import math
from functools import partial
from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.errors import first_line
from tp_train.parallel.agreement import before_collective
from tp_train.parallel.sharding import shard_tensor
from tp_train.plan.checking.verify import HALF_PRECISION_TOLERANCE, TOLERANCE, verification_error
from tp_train.plan.compare import detached, first_tensor, relative_difference
from tp_train.plan.gradient_hooks import requiring_grad
from tp_train.plan.probe import eval_mode, forward_without_cache, hooks_removed
from tp_train.plan.probe_input import PROBE_TOKENS, probe_input
from tp_train.plan.styles import FEATURE_REDUCTION_STYLE, NORM_STYLES, WHOLE_PARAMETER_STYLES, PlannedModule

# Region styles whose module takes whole inputs and returns a whole output once sharded, so that it alone can be
# compared with the module it was (`moe_identity_expert` and `mla_kv_a_proj` hand partial values on by design), and
# styles whose module takes and returns this rank's share of the features (the last dim), compared with that share of
# the unsharded module's output and gradients.
CHECKED_STYLES = ("moe_tp_experts", "all_reduce", *NORM_STYLES, FEATURE_REDUCTION_STYLE)
FEATURE_SPLIT_STYLES = (*NORM_STYLES, FEATURE_REDUCTION_STYLE)


class RegionCheck:
    """Checks each module planned in `CHECKED_STYLES` against itself before sharding: `record` before `apply_plan`,
    `check` after; `errors` per module, `skipped` says why nothing was checked, or None."""

    def __init__(self, group: ProcessGroup, planned: list[PlannedModule], tolerance: float | None = None):
        self.group = group
        self.entries = {entry.name: entry for entry in planned if entry.style in CHECKED_STYLES}
        self.tolerance = tolerance
        self.errors: dict[str, float] = {}
        self.skipped: str | None = None
        self._references: dict[str, _Run] = {}

    def record(self, model: nn.Module, example_input=None) -> None:
        """Captures each checked module's arguments and its unsharded results (before `apply_plan`), in one forward
        of `model` on `example_input` (`tp_train.plan.probe_input`; default the model's own). The ranks then agree
        (a collective): when any rank could not record, no rank checks."""
        if not self.entries:
            return
        try:
            self._record(model, example_input)
        except _NotRecorded as reason:
            self.skipped = str(reason)
        before_collective()
        reasons: list[str | None] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(reasons, self.skipped, group=self.group)
        first = next(((rank, reason) for rank, reason in enumerate(reasons) if reason), None)
        if first is not None:
            self._references.clear()
            self.skipped = first[1] if first[1] == self.skipped else f"{first[1]} on rank {first[0]}"

    def _record(self, model: nn.Module, example_input) -> None:
        if any(tensor.is_meta for tensor in chain(model.parameters(), model.buffers())):
            raise _NotRecorded("the model is on the meta device")
        arguments: dict[str, tuple] = {}

        def capture(name, module, args, kwargs):
            arguments.setdefault(name, detached((args, kwargs)))

        modules = {name: model.get_submodule(name) for name in self.entries}
        handles = [
            module.register_forward_pre_hook(partial(capture, name), with_kwargs=True)
            for name, module in modules.items()
        ]
        length = math.lcm(PROBE_TOKENS, dist.get_world_size(self.group))
        try:
            with hooks_removed(handles), eval_mode(model), torch.no_grad():
                forward_without_cache(model, probe_input(model, example_input, length, batch=2))
        except Exception as error:  # noqa: BLE001 - not the plan's fault; the whole-model check reports it if on
            raise _NotRecorded(f"the unsharded model cannot run a probe batch ({first_line(error)})") from error
        for name, (args, kwargs) in arguments.items():
            with eval_mode(modules[name]):
                self._references[name] = _run(modules[name], args, kwargs, _whole(modules[name], self.entries[name]))

    def check(self, model: nn.Module) -> None:
        """Runs each sharded module on its captured arguments (after `apply_plan`, before other weights are loaded;
        a collective) and raises `PlanVerificationError` at the first that differs or fails on this rank (run it in
        `failures_agreed`, so that every rank raises it)."""
        rank, tp = dist.get_rank(self.group), dist.get_world_size(self.group)
        references, self._references = self._references, {}
        for name, reference in references.items():
            module, entry = model.get_submodule(name), self.entries[name]
            split = (rank, tp) if entry.style in FEATURE_SPLIT_STYLES else None
            if split is not None:
                reference = reference.local(module, rank, tp)
            dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
            tolerance = self.tolerance or TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)
            failure = None
            try:
                with eval_mode(module):
                    errors = reference.differences(_run(module, *reference.arguments, reference.param_grads, split))
            except Exception as error:  # noqa: BLE001 - a module that cannot run is reported like a wrong one
                errors, failure = {"output": math.inf}, f"fails on the probe's arguments ({first_line(error)})"
            worst = max(errors, key=errors.get)
            self.errors[name] = errors[worst]
            if failure or errors[worst] > tolerance:
                entries = ", ".join(f"'{name}.{key}': '{style}'" for key, style in entry.parameters.items())
                what = failure or (
                    f"differs from the unsharded module by {errors[worst]:.3g} in its {worst} (relative; tolerance "
                    f"{tolerance:.0e}) on the probe batch's arguments"
                )
                entries = f" with {entries}" if entries else ""
                problem = f"module '{name}' ({type(module).__name__}) planned '{entry.style}'{entries} {what}"
                raise verification_error(problem, self.group)


class _NotRecorded(Exception):
    """Why this rank recorded no reference runs."""


class _Run:
    """One module's results on captured arguments: its output, the floating arguments' gradients, and the gradients
    of its own parameters every rank holds whole, by name."""

    def __init__(self, arguments, output, input_grads, param_grads):
        self.arguments, self.output, self.input_grads, self.param_grads = arguments, output, input_grads, param_grads

    def local(self, module: nn.Module, rank: int, tp: int) -> _Run:
        """This rank's share of a run on whole features (the last dim of every floating argument and of the output),
        and of the gradients of `module`'s parameters, split as its `shard_specs` say."""

        def share(value):
            return value.chunk(tp, -1)[rank] if _floating(value) else value

        args, kwargs = self.arguments
        specs = getattr(module, "shard_specs", {})
        param_grads = {
            name: shard_tensor(grad, specs[name], rank, tp) if name in specs else grad
            for name, grad in self.param_grads.items()
        }
        arguments = (tuple(share(v) for v in args), {key: share(v) for key, v in kwargs.items()})
        grads = {label: share(grad) for label, grad in self.input_grads.items()}
        return _Run(arguments, share(self.output), grads, param_grads)

    def differences(self, other: _Run) -> dict[str, float]:
        errors = {"output": _relative_or_inf(other.output, self.output)}
        for label, expected in self.input_grads.items():
            errors[f"gradient of {label}"] = _relative_or_inf(other.input_grads[label], expected)
        for param_name, expected in self.param_grads.items():
            if param_name in other.param_grads:
                errors[f"{param_name} gradient"] = _relative_or_inf(other.param_grads[param_name], expected)
        return errors


def _run(module: nn.Module, args: tuple, kwargs: dict, whole, split: tuple[int, int] | None = None) -> _Run:
    """`module` on fresh leaf copies of the arguments, and one random projection of its output backpropagated;
    the gradients kept are those of its own parameters named in `whole`. `split` (rank, tp): the output is that
    rank's share of the features, projected by its share of the whole output's projection."""
    inputs = [value.clone().requires_grad_() for value in chain(args, kwargs.values()) if _floating(value)]
    fresh = iter(inputs)
    call_args = tuple(next(fresh) if _floating(value) else value for value in args)
    call_kwargs = {key: next(fresh) if _floating(value) else value for key, value in kwargs.items()}
    try:
        with requiring_grad(module.parameters(), torch.is_floating_point), torch.enable_grad():
            output = first_tensor(module(*call_args, **call_kwargs))
            if output is None:
                raise TypeError(f"{type(module).__name__} returned no tensor")
            shape = (*output.shape[:-1], output.shape[-1] * (split[1] if split else 1))
            projection = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(output)
            projection = projection.chunk(split[1], -1)[split[0]] if split else projection
            (output.float() * projection).sum().backward()
        params = dict(module.named_parameters(recurse=False))
        param_grads = {name: params[name].grad.detach() for name in whole if params[name].grad is not None}
        labels = [f"argument {i}" for i, v in enumerate(args) if _floating(v)]
        labels += [f"argument '{key}'" for key, v in kwargs.items() if _floating(v)]
        input_grads = {
            label: value.grad if value.grad is not None else torch.zeros_like(value)
            for label, value in zip(labels, inputs, strict=True)
        }
        return _Run((args, kwargs), output.detach(), input_grads, param_grads)
    finally:
        module.zero_grad(set_to_none=True)


def _whole(module: nn.Module, entry: PlannedModule) -> list[str]:
    """`module`'s own parameters that no entry of the plan splits (every rank keeps them whole), and all of them for a
    module whose style splits them with the features (their shards are compared)."""
    split = {key for key, style in entry.parameters.items() if style not in WHOLE_PARAMETER_STYLES}
    names = [name for name, _ in module.named_parameters(recurse=False)]
    return names if entry.style in FEATURE_SPLIT_STYLES else [name for name in names if name not in split]


def _floating(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _relative_or_inf(tensor: torch.Tensor, reference: torch.Tensor) -> float:
    return math.inf if tensor.shape != reference.shape else relative_difference(tensor, reference)
