"""The dtype a reduction over a sharded tensor runs in (a loss's log-sum-exp, a norm's statistic, the clipping norm):
float32 for the narrower floats (bf16, fp16), the tensor's own when it is wider, so that a float64 model
(`precision=64`) is never rounded to float32 on the way."""

from __future__ import annotations

import torch


def statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32, or `dtype` where it is wider (float64)."""
    return torch.promote_types(dtype, torch.float32)


def widened(x: torch.Tensor) -> torch.Tensor:
    """`x` in `statistics_dtype(x.dtype)` (`x` itself when it already is)."""
    return x.to(statistics_dtype(x.dtype))
