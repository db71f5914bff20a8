"""Reductions over features split across ranks, completed by an all-reduce (the `feature_reduction_parallel` style)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from tp_train.parallel.collectives import CommunicationCounter, sum_across_tensor_parallel_region
from tp_train.parallel.layers import Configurable

MEANS = (torch.mean, torch.Tensor.mean)
SUMS = (torch.sum, torch.Tensor.sum)


def _over_features(func, args: tuple, kwargs: dict) -> bool:
    """Whether `func(*args, **kwargs)` reduces over the last dimension of its input (refusing one that reduces over it
    together with others, or over every dimension)."""
    if func not in MEANS + SUMS + (F.normalize,) or not args or not isinstance(args[0], torch.Tensor):
        return False
    x = args[0]
    if func is F.normalize:
        dim = kwargs.get("dim", args[2] if len(args) > 2 else 1)
    else:
        dim = kwargs.get("dim", args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else None)
    dims = {d % x.dim() for d in (dim if isinstance(dim, (tuple, list)) else (dim,))} if dim is not None else None
    if dims is None or (x.dim() - 1 in dims and len(dims) > 1):
        raise TypeError(
            f"'{getattr(func, '__name__', func)}' over dims {dim} of a {tuple(x.shape)} tensor reduces the split "
            f"features together with other dims; only reductions over the last dim alone are completed across ranks"
        )
    return dims == {x.dim() - 1}


class _CompletedReductions(TorchFunctionMode):
    """Completes each mean, sum or L2 normalize over the last dimension by an all-reduce over `group`."""

    def __init__(self, group: ProcessGroup, comm_counter: CommunicationCounter | None):
        super().__init__()
        self.group, self.comm_counter = group, comm_counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _over_features(func, args, kwargs):
            return func(*args, **kwargs)
        x, tp = args[0], dist.get_world_size(self.group)
        if func is F.normalize:
            p, eps = kwargs.get("p", args[1] if len(args) > 1 else 2.0), kwargs.get("eps", 1e-12)
            if p != 2:
                raise TypeError(f"normalize with p={p} over split features; only p=2 is completed across ranks")
            squares = sum_across_tensor_parallel_region(x.pow(2).sum(-1, keepdim=True), self.group, self.comm_counter)
            return x / squares.sqrt().clamp_min(eps)
        keepdim = kwargs.get("keepdim", args[2] if len(args) > 2 else False)
        total = sum_across_tensor_parallel_region(x.sum(-1, keepdim=True), self.group, self.comm_counter)
        total = total / (x.shape[-1] * tp) if func in MEANS else total
        return total if keepdim else total.squeeze(-1)


class FeatureReductionRegion(Configurable):
    """Runs a module's forward with its reductions over the (split) last dimension completed across the ranks (see
    the module docstring)."""

    SETTINGS = ("comm_counter",)

    def __init__(self, group: ProcessGroup, comm_counter: CommunicationCounter | None = None):
        self.group, self.comm_counter = group, comm_counter

    def install(self, module: nn.Module) -> None:
        if dist.get_world_size(self.group) > 1:
            run_forward_in_mode(module, lambda *_: _CompletedReductions(self.group, self.comm_counter))


class _Replayed(TorchFunctionMode):
    """Returns, for the n-th reduction over the last dimension, the n-th of `values` (recorded with `record`)."""

    def __init__(self, values: list[torch.Tensor] | None = None):
        super().__init__()
        self.values, self.recording = values if values is not None else [], values is None
        self.index = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _over_features(func, args, kwargs):
            return func(*args, **kwargs)
        if self.recording:
            self.values.append(func(*args, **kwargs) if func is not F.normalize else args[0].norm(dim=-1, keepdim=True))
            return func(*args, **kwargs)
        value, self.index = self.values[self.index], self.index + 1
        if func is F.normalize:
            return args[0] / value.clamp_min(kwargs.get("eps", 1e-12))
        return value


def held_reductions(module: nn.Module, reference: torch.Tensor) -> list[RemovableHandle]:
    """Runs each forward of `module` with each reduction over its input's features held at its value on `reference`
    (an input it saw before, its only positional argument then): the planner's probes. Returns the hooks' handles."""

    def held(*_) -> _Replayed:
        recorder = _Replayed()
        with torch.no_grad(), recorder:
            module.forward(reference)
        return _Replayed(recorder.values)

    return run_forward_in_mode(module, held)


def run_forward_in_mode(module: nn.Module, mode_for) -> list[RemovableHandle]:
    """Runs each forward of `module` inside the TorchFunctionMode `mode_for(args, kwargs)` returns (None: in none),
    left as the forward ends, raising or not; returns the two hooks' handles."""
    modes: list[TorchFunctionMode | None] = []

    def enter(module, args, kwargs):
        modes.append(mode_for(args, kwargs))
        if modes[-1] is not None:
            modes[-1].__enter__()

    def leave(module, args, output):
        if modes and (mode := modes.pop()) is not None:
            mode.__exit__(None, None, None)

    enter_handle = module.register_forward_pre_hook(enter, with_kwargs=True)
    return [enter_handle, module.register_forward_hook(leave, always_call=True)]
