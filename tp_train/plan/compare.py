"""Comparing a module's outputs: the tensor a forward's output leads with, and the relative difference of two,
shared by verification, the region check and the planner's rank simulation."""

from __future__ import annotations

import torch


def first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((value for value in values if isinstance(value, torch.Tensor)), None)


def detached(value):
    """`value` with each tensor in it (through tuples, lists and dicts) detached and copied."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple):
        return tuple(detached(item) for item in value)
    if isinstance(value, list):
        return [detached(item) for item in value]
    if isinstance(value, dict):
        return {key: detached(item) for key, item in value.items()}
    return value


def relative_difference(tensor: torch.Tensor, reference: torch.Tensor) -> float:
    if tensor.shape != reference.shape:
        return 0.0  # a sharded module's local output: not comparable, and not the first difference
    scale = max(reference.abs().max().item(), 1e-30)
    return (tensor.float() - reference.float()).abs().max().item() / scale
