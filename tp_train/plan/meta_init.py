"""Giving a module built on the meta device real storage and initial weights: shared by applying a plan (each
rank's shards) and by the planner's probe (a CPU copy to run a probe batch through)."""

from __future__ import annotations

import torch
import torch.nn as nn


def init_weights_of(root: nn.Module, name: str):
    """The weight initialiser of the innermost module enclosing `root`'s submodule `name` that has one (a Hugging
    Face model's `_init_weights`), or None: a model planned from a wrapper (a LightningModule holding a Hugging Face
    model the auto-planner plans through) initialises each module as the model itself would. Its rotary
    embeddings' computed buffers (StableLM's `inv_freq`, no `reset_parameters`) are recomputed so, as Hugging
    Face's own meta-device loading does (issue 41)."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        init_weights = getattr(owner, "_init_weights", None)
        if callable(init_weights):
            return init_weights
    return None


def materialize(name: str, module: nn.Module, device: torch.device, materialized: dict, init_weights=None) -> None:
    """Gives `module`'s own meta-device tensors storage on `device` and initialises them: `init_weights(module)`
    when given, else `module.reset_parameters()`. `materialized` maps each meta tensor given storage before (the
    tensor itself, which the key keeps alive: an id, once its tensor is freed, is another tensor's) to its real one,
    so a tensor tied across modules is materialised once."""
    fresh = False
    for tensors in (module._parameters, module._buffers):
        for key, tensor in tensors.items():
            if tensor is None or not tensor.is_meta:
                continue
            if tensor not in materialized:
                real = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                materialized[tensor] = real
                fresh = True
            tensors[key] = materialized[tensor]
    if not fresh:
        return
    if init_weights is not None:
        init_weights(module)
        return
    if not hasattr(module, "reset_parameters"):
        raise ValueError(
            f"module '{name}' ({type(module).__name__}) was built on the meta device but has no reset_parameters() "
            f"to initialise it; define one, or build the model on a real device"
        )
    module.reset_parameters()
