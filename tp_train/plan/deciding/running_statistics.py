"""For the probe, norms that keep running statistics (LeViT's BatchNorms) hold the probe batch's own statistics, as a
training step would have them (their initial zeros and ones hide what a query does); restored after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from tp_train.plan.caches import tensor_caches
from tp_train.plan.probe import hooks_removed
from tp_train.plan.probe_input import ProbeInput


def running_norms(model: nn.Module) -> list[nn.Module]:
    """The norms of `model` that normalise by running statistics in eval mode (torch's BatchNorm and its kin)."""
    return [
        module
        for module in model.modules()
        if isinstance(module, nn.modules.batchnorm._NormBase) and module.track_running_stats
    ]


@contextmanager
def probe_statistics(model: nn.Module, inputs: ProbeInput) -> Iterator[None]:
    """`model`'s running norms holding `inputs`' statistics for the duration (left as they were where a norm sees one
    value per channel, too few for statistics); each norm's buffers, momentum and mode restored after."""
    norms = running_norms(model)
    saved = [(norm, norm.momentum, norm.training, {k: v.clone() for k, v in norm.named_buffers(recurse=False)})
             for norm in norms]  # fmt: skip
    handles = [norm.register_forward_pre_hook(_takes_statistics) for norm in norms]
    try:
        for norm in norms:
            norm.momentum = 1.0
        try:
            if norms:
                with hooks_removed(handles), torch.no_grad():
                    inputs(model)
        except Exception:  # noqa: BLE001 - a model that cannot run its probe input is refused where the planner runs it
            _restore(saved)
        for cache in tensor_caches(model):  # filled by this forward, outside the probe's dataflow
            cache.clear()
        for norm in norms:
            norm.eval()
        yield
    finally:
        _restore(saved)


def _restore(saved: list) -> None:
    for norm, momentum, training, buffers in saved:
        norm.momentum, norm.training = momentum, training
        for name, value in buffers.items():
            getattr(norm, name).copy_(value)


def _takes_statistics(norm: nn.Module, args: tuple) -> None:
    """A norm takes its input's statistics (training mode) where it has more than one value per channel."""
    x = args[0]
    norm.training = x.dim() > 1 and x.numel() // x.shape[1] > 1
