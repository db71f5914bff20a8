"""Parameters tied across pipeline stages (GPT-2's embedding and LM head): each stage that holds one keeps its own
copy, and after backward the copies' gradients are summed, so each equals the tied parameter's gradient in the whole
model and every copy takes the same optimizer step (Megatron's embedding group does the same)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor

from tp_train.parallel.sharding import local_part

# The attribute of a cut stage holding {each name of a tied parameter: all its names in the whole model}
TIED_NAMES = "pipeline_tied_names"


@dataclass(frozen=True)
class Tie:
    names: tuple[str, ...]  # the names one parameter has in the whole model
    shape: tuple[int, ...]  # its shape on this rank (a rank holding no copy adds zeros of it)
    dtype: torch.dtype


def tied_parameters(model: nn.Module) -> list[Tie]:
    """The parameters of `model` that appear under more than one name."""
    names: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
        params[id(param)] = param
    return [
        Tie(tuple(group), tuple(params[key].shape), params[key].dtype) for key, group in names.items() if len(group) > 1
    ]


def sum_tied_gradients(models: list[nn.Module], ties: list[Tie], group: ProcessGroup | None) -> None:
    """For each tied parameter, sums the gradients of its copies in this rank's stage `models` and, with `group`
    (the pipeline group: every rank calls this, holding a copy or not), across ranks; each copy gets the sum.

    Forward: nothing. Backward: one all-reduce (sum) per tied parameter over the pipeline group."""
    for tie in ties:
        copies: dict[int, nn.Parameter] = {}
        for model in models:
            held = dict(model.named_parameters(remove_duplicate=False))
            for name in tie.names:
                if name in held:
                    copies.setdefault(id(held[name]), held[name])
        if len(copies) <= 1 and group is None:
            continue
        # The local parts: under FSDP2 each copy's gradient is this data-parallel rank's shard of it, alike on
        # every stage (the copies have one shape), so the sum over the stages is shard by shard.
        total = None
        for param in copies.values():
            if param.grad is not None:
                grad = local_part(param.grad)
                total = grad.clone() if total is None else total + grad
        if group is not None:
            if total is None:  # no copy here (a middle stage), or no gradient yet: add zeros
                dtype = next(iter(copies.values())).dtype if copies else tie.dtype
                total = torch.zeros(tie.shape, dtype=dtype, device=_device(models))
            dist.all_reduce(total, group=group)
        for param in copies.values():
            grad = param.grad
            if isinstance(grad, DTensor):
                param.grad = DTensor.from_local(
                    total.clone(), grad.device_mesh, grad.placements, shape=grad.shape, stride=grad.stride()
                )
            else:
                param.grad = total.clone() if len(copies) > 1 else total


def _device(models: list[nn.Module]) -> torch.device:
    param = next((p for model in models for p in model.parameters()), None)
    return param.device if param is not None else torch.device("cpu")
