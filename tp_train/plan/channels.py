"""The `channelwise` style: a module whose own parameters hold one entry per channel between a column and a row layer
(an SSM's conv1d, A_log and D; a gated norm's weight) keeps each rank's channels' entries, by sections if named."""

from __future__ import annotations

import functools

import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.sharding import ShardSpec, replicated_rows, shard_tensor, sum_replicated_gradient
from tp_train.plan.gradient_hooks import SUM_REPLICAS, register_gradient_hook
from tp_train.plan.styles import style_shard_spec

CHANNEL_COUNTS = ("in_channels", "out_channels", "groups", "num_channels", "normalized_shape", "num_features")


def shard_channels(module: nn.Module, group: ProcessGroup, arguments: str = "") -> None:
    """Replaces each of `module`'s own parameters by this rank's chunk along dim 0 (of each section the style's
    `arguments` name, else one contiguous chunk), records the split in `module.shard_specs` (for checkpoints and
    gathering), its per-channel buffers with them (a BatchNorm's running statistics), sums the gradients of replicated
    sections over their replicas, and sets its channel counts (a Conv's `groups`, `in_channels`, `out_channels`, a
    BatchNorm's `num_features`) to the channels this rank holds."""
    tp = dist.get_world_size(group)
    for name, spec in local_channels(module, dist.get_rank(group), tp, arguments).items():
        if name in module._parameters and replicated_rows(spec, tp):
            hook = functools.partial(sum_replicated_gradient, spec=spec, group=group)
            register_gradient_hook(module, name, hook, once=SUM_REPLICAS)


def local_channels(module: nn.Module, rank: int, tp: int, arguments: str = "") -> dict[str, ShardSpec]:
    """`module` made to hold rank `rank`'s channels of `tp` (its parameters, per-channel buffers and channel counts,
    as `shard_channels` says), with no process group: what the local-view search simulates a rank with. Returns the
    specs of the tensors it split (also recorded in `module.shard_specs`)."""
    channels = local_count = None
    split = {}
    for name, param in list(module.named_parameters(recurse=False)):
        channels = param.shape[0]
        spec = style_shard_spec("channelwise", module, name, arguments=arguments)
        local = nn.Parameter(shard_tensor(param.detach(), spec, rank, tp), requires_grad=param.requires_grad)
        setattr(module, name, local)
        split[name] = spec
        local_count = local.shape[0]
    for name, buffer in list(module.named_buffers(recurse=False)):
        # per-channel statistics (a BatchNorm's running_mean and running_var): this rank's channels, as its weight
        if buffer.dim() and buffer.shape[0] == channels and buffer.is_floating_point():
            split[name] = style_shard_spec("channelwise", module, name, arguments=arguments)
            module._buffers[name] = shard_tensor(buffer, split[name], rank, tp)
    module.shard_specs = {**getattr(module, "shard_specs", {}), **split}
    for attribute in CHANNEL_COUNTS:
        value = getattr(module, attribute, None)
        if isinstance(value, int) and value == channels:
            setattr(module, attribute, local_count)
        elif isinstance(value, tuple) and value and value[0] == channels:
            setattr(module, attribute, (local_count, *value[1:]))
    return split
