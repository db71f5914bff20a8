"""The `channelwise` style: a module whose own parameters hold one entry per channel of the activation between a
column and a row layer (a state-space block's depthwise conv1d, A_log and D; a gated norm's weight) keeps, on each
rank, the entries of that rank's channels, so it runs on the column layer's local output. Nothing is communicated:
the gradients of those entries are whole on the rank that holds them."""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.sharding import shard_tensor
from tp_train.plan.styles import style_shard_spec

CHANNEL_COUNTS = ("in_channels", "out_channels", "groups", "num_channels", "normalized_shape")


def shard_channels(module: nn.Module, group: ProcessGroup, arguments: str = "") -> None:
    """Replaces each of `module`'s own parameters by this rank's contiguous chunk along dim 0 (of each section
    `arguments` names, `channelwise(64,16,16)`, else of the whole), records the split in
    `module.shard_specs` (for checkpoints and gathering), and divides its channel counts (a Conv's `groups`,
    `in_channels`, `out_channels`) by tp."""
    rank, tp = dist.get_rank(group), dist.get_world_size(group)
    channels = None
    specs = dict(getattr(module, "shard_specs", {}))
    for name, param in list(module.named_parameters(recurse=False)):
        channels = param.shape[0]
        spec = style_shard_spec("channelwise", module, name, arguments=arguments)
        local = nn.Parameter(shard_tensor(param.detach(), spec, rank, tp), requires_grad=param.requires_grad)
        setattr(module, name, local)
        specs[name] = spec
    module.shard_specs = specs
    for attribute in CHANNEL_COUNTS:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and value == channels:
            setattr(module, attribute, value // tp)
        elif isinstance(value, tuple) and value and value[0] == channels:
            setattr(module, attribute, (value[0] // tp, *value[1:]))
