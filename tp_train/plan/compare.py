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


def relative_difference(tensor: torch.Tensor, reference: torch.Tensor) -> float:
    if tensor.shape != reference.shape:
        return 0.0  # a sharded module's local output: not comparable, and not the first difference
    scale = max(reference.abs().max().item(), 1e-30)
    return (tensor.float() - reference.float()).abs().max().item() / scale
