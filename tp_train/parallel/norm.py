"""An RMS norm over features split across ranks (the `rmsnorm_parallel` style; BitNet's sub-norms).

A norm that sits between a column and a row layer (BitNet's `attn_sub_norm` before o_proj, `ffn_sub_norm` before
down_proj) sees only this rank's share of the features, and its weight is split with them. Its own forward runs
on them unchanged; `ParallelRMSNormRegion` then corrects its output by the ratio of the two normalisations:

    y = module(x_local) * sqrt(mean_local(x^2) + eps) / sqrt(mean_global(x^2) + eps)

where `mean_global` is the sum of squares all-reduced over the group (`sum_across_tensor_parallel_region`,
all-reduced in backward too) divided by the full width. For any module computing `w * x * rsqrt(mean(x^2) + eps)`
(whatever it does to `w`, Gemma's `1 + w` included) this is the unsharded result on this rank's features, with one
all-reduce of one number per token each way; statistics are computed in float32, as Hugging Face's norms do. A
module that normalises another way is not corrected right: verification (`tp_train.plan.region_check`) runs it on
its share of a probe's features and refuses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import CommunicationCounter, sum_across_tensor_parallel_region
from tp_train.parallel.layers import Configurable

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


def hold_statistic(module: nn.Module, x: torch.Tensor, output: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """An RMS norm's `output` on `x` rescaled as if its mean of squares were that of `reference` (an input it saw
    before): it then acts on each feature alone, as it will on each rank's share once `rmsnorm_parallel` corrects
    it (the auto-planner's probes, which look for what moves which features)."""
    eps = norm_epsilon(module)[1]
    eps = eps if eps is not None else torch.finfo(x.dtype).eps
    held = reference.detach().float().pow(2).mean(-1, keepdim=True)
    now = x.float().pow(2).mean(-1, keepdim=True)
    # Exactly 1 where the statistic did not move: a row nothing perturbed must not move by round-off either.
    scale = torch.where(now == held, 1.0, torch.sqrt(now + eps) * torch.rsqrt(held + eps))
    return output * scale.to(output)


class ParallelRMSNormRegion(Configurable):
    """Corrects an RMS norm running on this rank's features to normalise over every rank's (see the module
    docstring). `install(module)` hooks its forward; its first floating-point tensor argument is the input."""

    SETTINGS = ("comm_counter",)

    def __init__(self, group: ProcessGroup, eps: float | None, comm_counter: CommunicationCounter | None = None):
        self.group, self.eps, self.comm_counter = group, eps, comm_counter

    def install(self, module: nn.Module) -> None:
        module.register_forward_hook(self._output, with_kwargs=True)

    def scale(self, x: torch.Tensor) -> torch.Tensor:
        """sqrt(mean_local(x^2) + eps) / sqrt(mean_global(x^2) + eps), in float32, one value per row of `x`."""
        width, tp = x.shape[-1], dist.get_world_size(self.group)
        eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps
        squares = x.float().pow(2).sum(-1, keepdim=True)
        total = sum_across_tensor_parallel_region(squares, self.group, self.comm_counter)
        return torch.sqrt(squares / width + eps) * torch.rsqrt(total / (width * tp) + eps)

    def _output(self, module, args, kwargs, output):
        if dist.get_world_size(self.group) == 1:
            return output
        x = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
        first = output[0] if isinstance(output, tuple) and output else output
        if x is None or not isinstance(first, torch.Tensor):
            raise TypeError(f"{type(module).__name__} takes or returns no tensor for 'rmsnorm_parallel' to correct")
        corrected = (first.float() * self.scale(x)).to(first.dtype)
        return (corrected, *output[1:]) if isinstance(output, tuple) else corrected
