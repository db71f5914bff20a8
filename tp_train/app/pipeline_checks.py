"""`pp=N` checked before any rank starts, each problem in one line: more stages than the model has blocks or virtual
stages that do not split them evenly (`ParallelDims.validate`), a model whose blocks cannot be found, microbatches
that do not divide the batch, and a schedule or composition the strategy refuses. The devices pp does not divide are
also `ParallelDims.validate`'s, called by the preflight."""

from __future__ import annotations

import torch.nn as nn
from omegaconf import DictConfig

from tp_train.errors import ConfigError
from tp_train.lightning.arguments import check_pipeline_arguments
from tp_train.parallel.dims import ParallelDims
from tp_train.training.pipeline_split import count_blocks, plan_pipeline_split


def check_pipeline(cfg: DictConfig, model: nn.Module, dims: ParallelDims | None = None) -> None:
    """Raises `ConfigError` for the first problem with `cfg.pp` (and the strategy's pipeline_* keys) on `model`
    (built on the meta device); `dims`: the config's degrees (`config_dims`), already validated without the model."""
    pp = cfg.get("pp", 1)
    if not isinstance(pp, int) or pp < 1:
        raise ConfigError(f"pp={pp} must be a positive integer (the pipeline stages), e.g. pp=2")
    if pp == 1:
        return
    strategy = cfg.trainer.get("strategy") or {}
    schedule = strategy.get("pipeline_schedule", "1f1b")
    microbatches = strategy.get("pipeline_microbatches") or pp
    virtual = strategy.get("pipeline_virtual_stages") or 1
    try:
        check_pipeline_arguments(pp, schedule, microbatches, virtual)
    except ValueError as error:
        raise ConfigError(f"pp={pp}: {error}") from None
    batch_size = cfg.data.get("batch_size")
    if isinstance(batch_size, int) and batch_size % microbatches:
        fit = batch_size + microbatches - batch_size % microbatches
        raise ConfigError(
            f"data.batch_size={batch_size} is not a multiple of trainer.strategy.pipeline_microbatches={microbatches}"
            f" (each batch runs as that many microbatches); use data.batch_size={fit}"
        )
    try:  # the stages against the model's blocks, then the split itself
        dims = dims or ParallelDims(pp=pp, virtual_stages=virtual, world_size=pp)
        dims.validate("trainer.devices", cfg.trainer.get("num_nodes", 1), blocks=count_blocks(model))
        plan_pipeline_split(model, dims.stages, explicit=strategy.get("pipeline_split"))
    except ValueError as error:
        raise ConfigError(f"pp={pp}: {error}") from None
