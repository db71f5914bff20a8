"""The numeric `data.*` and `trainer.*` values Lightning or the data module would reject, refused up front."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import DictConfig

from tp_train.errors import ConfigError


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _at_least(minimum: int, optional: bool = False) -> Callable[[Any], bool]:
    return lambda value: (optional and value is None) or (_integer(value) and value >= minimum)


def _batches_limit(value: Any) -> bool:
    """Lightning's `limit_*_batches` / `overfit_batches`: a count of batches, or a fraction of them."""
    return value is None or (_integer(value) and value >= 0) or (isinstance(value, float) and 0.0 <= value <= 1.0)


_LIMIT = "an integer number of batches >= 0 or a fraction in [0.0, 1.0]"

RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("dp", _at_least(1), "a positive integer (data-parallel replicas per node), e.g. dp=2"),
    ("dp_shard", _at_least(2, optional=True), "an integer >= 2 dividing dp (ranks per FSDP2 shard group), or null"),
    ("ep", _at_least(1), "a positive integer (ranks among dp x cp that split each layer's experts), e.g. ep=2"),
    ("data.batch_size", _at_least(1), "a positive integer (sequences per batch on each replica), e.g. 8"),
    ("data.block_size", _at_least(2), "an integer >= 2 (tokens per sequence), e.g. 128"),
    ("data.num_workers", _at_least(0), "an integer >= 0 (0 loads batches in the training process)"),
    ("data.val_fraction", lambda v: _number(v) and 0 < v < 1, "a fraction in (0, 1), e.g. 0.05"),
    ("data.max_files", _at_least(1, optional=True), "a positive integer, or null for every file"),
    ("data.max_bytes", _at_least(1, optional=True), "a positive integer, or null for no cap"),
    ("trainer.num_nodes", _at_least(1), "a positive integer"),
    ("trainer.max_steps", _at_least(-1), "a positive integer, or -1 for no step limit"),
    ("trainer.min_steps", _at_least(0, optional=True), "an integer >= 0, or null"),
    ("trainer.max_epochs", _at_least(-1, optional=True), "a positive integer, -1 for no limit, or null"),
    ("trainer.min_epochs", _at_least(0, optional=True), "an integer >= 0, or null"),
    ("trainer.check_val_every_n_epoch", _at_least(1, optional=True), "a positive integer, or null"),
    ("trainer.num_sanity_val_steps", _at_least(-1, optional=True), "an integer >= 0, -1 for all, or null"),
    ("trainer.log_every_n_steps", _at_least(0, optional=True), "a positive integer, e.g. 10 (0 logs nothing)"),
    ("trainer.accumulate_grad_batches", _at_least(1), "a positive integer (1: no accumulation)"),
    ("trainer.reload_dataloaders_every_n_epochs", _at_least(0), "an integer >= 0"),
    ("trainer.fast_dev_run", lambda v: isinstance(v, bool) or _at_least(0)(v), "true, false or a number of batches"),
    ("trainer.limit_train_batches", _batches_limit, _LIMIT),
    ("trainer.limit_val_batches", _batches_limit, _LIMIT),
    ("trainer.limit_test_batches", _batches_limit, _LIMIT),
    ("trainer.limit_predict_batches", _batches_limit, _LIMIT),
    ("trainer.overfit_batches", _batches_limit, _LIMIT),
    ("trainer.gradient_clip_val", lambda v: v is None or (_number(v) and v >= 0), "a number >= 0, or null (off)"),
    ("trainer.gradient_clip_algorithm", lambda v: v in (None, "norm", "value"), "norm or value"),
]


def check_values(cfg: DictConfig) -> None:
    """Raises `ConfigError` for the first value in `RULES` that is present in `cfg` and not accepted."""
    for key, accepts, works in RULES:
        value = _select(cfg, key)
        if value is not _MISSING and not accepts(value):
            shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
            raise ConfigError(f"{key}={shown} is out of range; use {works}")
    vocab = _select(cfg, "data.vocab_size")
    if _select(cfg, "data.tokenizer_path") in (None, _MISSING) and _integer(vocab) and vocab < 258:
        raise ConfigError(
            f"data.vocab_size={vocab} is out of range: the tokenizer trained on the corpus starts from 256 bytes "
            f"and EOS; use data.vocab_size>=258, e.g. 8192"
        )
    devices = _select(cfg, "trainer.devices")
    if _integer(devices) and devices < 1:
        raise ConfigError(f"trainer.devices={devices} is out of range; use a positive integer (or dp=..., tp=...)")
    interval = _select(cfg, "trainer.val_check_interval")
    if _number(interval):
        if _integer(interval) and interval < 1:
            raise ConfigError(f"trainer.val_check_interval={interval} is out of range; use a positive number of steps")
        if isinstance(interval, float) and _select(cfg, "trainer.check_val_every_n_epoch") in (None, _MISSING):
            raise ConfigError(
                f"trainer.val_check_interval={interval} is a fraction of an epoch, which needs "
                f"trainer.check_val_every_n_epoch; use a whole number of steps (e.g. 100) or set "
                f"trainer.check_val_every_n_epoch=1"
            )
        if isinstance(interval, float) and not 0.0 < interval <= 1.0:
            raise ConfigError(f"trainer.val_check_interval={interval} is out of range; use a fraction in (0.0, 1.0]")


_MISSING = object()


def _select(cfg: DictConfig, key: str) -> Any:
    node: Any = cfg
    for part in key.split("."):
        if not hasattr(node, "get") or part not in node:
            return _MISSING
        node = node.get(part)
    return node
