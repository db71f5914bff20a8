"""Caches a module keeps of what its parameters compute (LeViT's `attention_bias_cache`): a probe empties them and
restores them, and a module whose parameters a plan splits has them emptied, to compute them from its shards."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn


def tensor_caches(module: nn.Module, recurse: bool = True) -> list[dict]:
    """The dict attributes of `module` (and of its submodules) whose values are all tensors, empty ones included."""
    return [
        value
        for sub in (module.modules() if recurse else (module,))
        for key, value in vars(sub).items()
        if not key.startswith("_")
        and isinstance(value, dict)
        and all(isinstance(item, torch.Tensor) for item in value.values())
    ]


@contextmanager
def caches_kept(module: nn.Module) -> Iterator[None]:
    """`module`'s tensor caches empty for the block (a probe forward computes them, its dataflow recorded), and as
    they were before after it."""
    saved = [(cache, dict(cache)) for cache in tensor_caches(module)]
    for cache, _ in saved:
        cache.clear()
    try:
        yield
    finally:
        for cache, contents in saved:
            cache.clear()
            cache.update(contents)
