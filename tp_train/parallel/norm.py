"""An RMS norm over features split across ranks (the `rmsnorm_parallel` style; BitNet's sub-norms)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import CommunicationCounter, sum_across_tensor_parallel_region
from tp_train.parallel.layers import Configurable
from tp_train.parallel.widening import widened

# Where RMS norms keep the epsilon added inside their rsqrt (Hugging Face's `variance_epsilon`, torch's `eps`).
EPSILON_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps")


def norm_epsilon(module: nn.Module) -> tuple[bool, float | None]:
    """(found, epsilon) of an RMS norm: its first `EPSILON_ATTRIBUTES` entry; None for torch's `nn.RMSNorm(eps=None)`
    (the input dtype's machine epsilon)."""
    for attribute in EPSILON_ATTRIBUTES:
        if hasattr(module, attribute):
            value = getattr(module, attribute)
            if value is None or isinstance(value, (int, float)):
                return True, None if value is None else float(value)
    return False, None


def is_rms_norm(module: nn.Module) -> bool:
    """Whether `module` is recognisably an RMS norm with 1-D weights: torch's `nn.RMSNorm`, or a class named
    `...RMSNorm` (Hugging Face's `LlamaRMSNorm`, `BitNetRMSNorm`; not a gated one) keeping its epsilon. What it
    computes is not inferred from this: verification checks it."""
    params = list(module.parameters(recurse=False))
    named = isinstance(module, nn.RMSNorm) or type(module).__name__.endswith("RMSNorm")
    return named and norm_epsilon(module)[0] and bool(params) and all(param.dim() == 1 for param in params)


def is_layer_norm(module: nn.Module) -> bool:
    """Whether `module` is torch's `nn.LayerNorm` (or a subclass: Hugging Face's `EsmcLayerNorm`) over its last
    dimension alone, with or without its weight and bias."""
    return isinstance(module, nn.LayerNorm) and len(module.normalized_shape) == 1


def hold_statistic(module: nn.Module, x: torch.Tensor, output: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """An RMS norm's (or a LayerNorm's) `output` on `x` as if its statistic (mean of squares; mean and variance)
    were that of `reference` (an input it saw before): it then acts on each feature alone, as it will on each rank's
    share once `rmsnorm_parallel` (`layernorm_parallel`) corrects it (the auto-planner's probes, which look for what
    moves which features)."""
    if is_layer_norm(module):
        return _hold_moments(module, x, output, reference)
    eps = norm_epsilon(module)[1]
    eps = eps if eps is not None else torch.finfo(x.dtype).eps
    held = widened(reference.detach()).pow(2).mean(-1, keepdim=True)
    now = widened(x).pow(2).mean(-1, keepdim=True)
    # Exactly 1 where the statistic did not move: a row nothing perturbed must not move by round-off either.
    scale = torch.where(now == held, 1.0, torch.sqrt(now + eps) * torch.rsqrt(held + eps))
    return output * scale.to(output)


def _hold_moments(module: nn.LayerNorm, x: torch.Tensor, output: torch.Tensor, reference: torch.Tensor):
    """A LayerNorm's `output` on `x` normalised with the mean and variance of `reference` instead of its own (rows
    whose moments did not move keep `output` exactly)."""
    held_var, held_mean = torch.var_mean(widened(reference.detach()), -1, correction=0, keepdim=True)
    var, mean = torch.var_mean(widened(x), -1, correction=0, keepdim=True)
    held = _affine(module, (widened(x) - held_mean) * torch.rsqrt(held_var + module.eps))
    return torch.where((mean == held_mean) & (var == held_var), output, held.to(output))


def _affine(module: nn.Module, normalized: torch.Tensor) -> torch.Tensor:
    """`normalized` times the module's `weight` plus its `bias` (either may be None), in float32 or wider."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    scaled = normalized if weight is None else normalized * widened(weight)
    return scaled if bias is None else scaled + widened(bias)


class _FeatureSplitNorm(Configurable):
    """A norm running on this rank's share of the features whose output `corrected` makes that of the norm over every
    rank's (see the module docstring): `install(module)` hooks its forward; its first floating-point tensor argument
    is the input (its second, for a gated norm, the gate)."""

    SETTINGS = ("comm_counter",)
    STYLE = ""

    def install(self, module: nn.Module) -> None:
        module.register_forward_hook(self._output, with_kwargs=True)

    def corrected(self, module: nn.Module, tensors: list[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _output(self, module, args, kwargs, output):
        if dist.get_world_size(self.group) == 1:
            return output
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_floating_point()]
        first = output[0] if isinstance(output, tuple) and output else output
        if not tensors or not isinstance(first, torch.Tensor):
            raise TypeError(f"{type(module).__name__} takes or returns no tensor for '{self.STYLE}' to correct")
        corrected = self.corrected(module, tensors, first).to(first.dtype)
        return (corrected, *output[1:]) if isinstance(output, tuple) else corrected


class ParallelLayerNormRegion(_FeatureSplitNorm):
    """Recomputes a LayerNorm running on this rank's features from the mean and variance over every rank's (see the
    module docstring), with this rank's shares of its weight and bias."""

    STYLE = "layernorm_parallel"

    def __init__(self, group: ProcessGroup, eps: float, comm_counter: CommunicationCounter | None = None):
        self.group, self.eps, self.comm_counter = group, eps, comm_counter

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean, variance) over every rank's features, in float32 or wider, one value of each per row of `x`."""
        width, tp = x.shape[-1], dist.get_world_size(self.group)
        var, mean = torch.var_mean(widened(x), -1, correction=0, keepdim=True)
        local = torch.cat([mean, mean.pow(2), var * width], -1)  # its mean, the square of it, its M2
        totals = sum_across_tensor_parallel_region(local, self.group, self.comm_counter)
        means, squared_means, deviations = totals.split(1, -1)
        mean = means / tp
        variance = (deviations + width * (squared_means - tp * mean.pow(2)).clamp_min(0)) / (width * tp)
        return mean, variance

    def corrected(self, module, tensors, output):
        x = widened(tensors[0])
        mean, variance = self.moments(x)
        return _affine(module, (x - mean) * torch.rsqrt(variance + self.eps))


class ParallelRMSNormRegion(_FeatureSplitNorm):
    """Corrects an RMS norm running on this rank's features to normalise over those of every rank holding its group
    (see the module docstring). `install(module)` hooks its forward; its first floating-point tensor argument is the
    input, and with `gated` its second (if given) the gate. `groups`: how many groups of features it normalises
    apart (at most, and dividing, tp; 1 for a plain RMS norm)."""

    STYLE = "rmsnorm_parallel"

    def __init__(
        self,
        group: ProcessGroup,
        eps: float | None,
        comm_counter: CommunicationCounter | None = None,
        groups: int = 1,
        gated: bool = False,
    ):
        self.group, self.eps, self.comm_counter = group, eps, comm_counter
        self.groups, self.gated = groups, gated

    def scale(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """sqrt(mean_local(y^2) + eps) / sqrt(mean_group(y^2) + eps), in float32 or wider, one value per row of `x`,
        where y = x * silu(gate) (x without a gate) and the group is the one this rank's features belong to."""
        width, tp, rank = x.shape[-1], dist.get_world_size(self.group), dist.get_rank(self.group)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        y = widened(x) if gate is None else widened(x) * F.silu(widened(gate))
        squares = y.pow(2).sum(-1, keepdim=True)
        mine = rank * self.groups // tp
        per_group = [squares if index == mine else torch.zeros_like(squares) for index in range(self.groups)]
        totals = sum_across_tensor_parallel_region(torch.cat(per_group, -1), self.group, self.comm_counter)
        total = totals.narrow(-1, mine, 1)
        return torch.sqrt(squares / width + eps) * torch.rsqrt(total / (width * tp // self.groups) + eps)

    def corrected(self, module, tensors, output):
        gate = tensors[1] if self.gated and len(tensors) > 1 else None
        return widened(output) * self.scale(tensors[0], gate)


def norm_groups(module: nn.Module) -> int:
    """How many groups a gated, grouped RMS norm normalises apart: its width over its `group_size` (1 without)."""
    group_size = getattr(module, "group_size", None)
    width = next(iter(module.parameters(recurse=False))).shape[0]
    return width // group_size if isinstance(group_size, int) and group_size else 1
