"""`ep=N` checked before any rank starts, each problem in one line: a capacity factor that is not a positive number,
a model without experts, and ep above or not dividing a layer's number of experts. Whether ep divides the data x
context parallel ranks is `ParallelDims.validate`'s, called by the preflight."""

from __future__ import annotations

import torch.nn as nn
from omegaconf import DictConfig

from tp_train.errors import ConfigError
from tp_train.training.experts import check_expert_parallel, check_expert_parallel_arguments


def check_experts(cfg: DictConfig, model: nn.Module) -> None:
    """Raises `ConfigError` for the first problem with `cfg.ep` on `model` (built on the meta device)."""
    ep = cfg.get("ep", 1)
    strategy = cfg.trainer.get("strategy") or {}
    if ep == 1 and strategy.get("expert_capacity_factor") is None:
        return
    try:
        check_expert_parallel_arguments(ep, strategy.get("expert_capacity_factor"))
        check_expert_parallel(model, ep)
    except ValueError as error:
        raise ConfigError(f"ep={ep}: {error}") from None
