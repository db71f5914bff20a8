"""The AdamW that training (conf/optimizer/adamw.yaml) and the benchmark's contenders build: torch's AdamW with its
implementation chosen by the parameters' device."""

from __future__ import annotations

from collections.abc import Iterable

import torch

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")


def adamw(params: Iterable, implementation: str = "auto", **kwargs) -> torch.optim.AdamW:
    """`torch.optim.AdamW(params, **kwargs)` with one of torch's implementations.

    Args:
        params: parameters or parameter groups, already on their device.
        implementation: "auto" (foreach, one kernel per operation over all tensors, when every parameter is on a
            CUDA device; torch's own choice elsewhere, which works on CPU), "fused" (one kernel for the whole step;
            Lightning refuses gradient clipping with it under mixed precision, its `clip_gradients` in
            `MixedPrecision`, and conf/trainer clips by default), "foreach" or "for-loop".
        kwargs: AdamW's arguments (lr, betas, weight_decay, ...).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"optimizer.implementation={implementation!r}: choose one of {', '.join(IMPLEMENTATIONS)}")
    groups = [dict(group, params=list(group["params"])) if isinstance(group, dict) else group for group in params]
    choice = auto_implementation(_devices(groups)) if implementation == "auto" else implementation
    flags = {"fused": True} if choice == "fused" else {"foreach": choice == "foreach"} if choice != "default" else {}
    return torch.optim.AdamW(groups, **flags, **kwargs)


def auto_implementation(device_types: set[str]) -> str:
    """`foreach` when every parameter is on CUDA, else `default` (torch decides: what works on CPU)."""
    return "foreach" if device_types == {"cuda"} else "default"


def _devices(groups: list) -> set[str]:
    tensors = [p for group in groups for p in (group["params"] if isinstance(group, dict) else [group])]
    return {p.device.type for p in tensors}
