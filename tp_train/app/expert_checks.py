"""`ep=N` checked before any rank starts, each problem in one line: ep not dividing the data x context parallel
ranks, a capacity factor that is not a positive number, a model without experts, and ep above or not dividing a
layer's number of experts."""

from __future__ import annotations

import torch.nn as nn
from omegaconf import DictConfig

from tp_train.errors import ConfigError
from tp_train.lightning.experts import check_expert_parallel_arguments
from tp_train.plan.experts import check_expert_parallel


def check_experts(cfg: DictConfig, model: nn.Module) -> None:
    """Raises `ConfigError` for the first problem with `cfg.ep` on `model` (built on the meta device)."""
    ep = cfg.get("ep", 1)
    strategy = cfg.trainer.get("strategy") or {}
    if ep == 1 and strategy.get("expert_capacity_factor") is None:
        return
    tp, cp, pp = cfg.tp, cfg.get("cp", 1), cfg.get("pp", 1)
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if isinstance(devices, int) and (devices * nodes // (tp * pp)) % ep:
        replicas = devices * nodes // (tp * pp)
        fits = [n * tp * pp * ep for n in range(1, 5) if n * ep % cp == 0]
        raise ConfigError(
            f"ep={ep} does not divide dp x cp = {replicas} (trainer.devices={devices} x trainer.num_nodes={nodes} "
            f"over tp={tp} x pp={pp}); expert parallelism splits the experts among those ranks, it adds none: use "
            f"trainer.devices in {fits} (or leave it: tp x pp x dp x cp raised to a multiple of ep)"
        )
    try:
        check_expert_parallel_arguments(ep, strategy.get("expert_capacity_factor"))
        check_expert_parallel(model, ep)
    except ValueError as error:
        raise ConfigError(f"ep={ep}: {error}") from None
