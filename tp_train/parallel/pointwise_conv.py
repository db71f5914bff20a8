"""Tensor-parallel 1x1 convolutions: a pointwise nn.Conv2d is a linear layer over the channels at dim 1, so it splits
as `ColumnParallelLinear` / `RowParallelLinear` do (SwiftFormer's and other vision MLPs)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import reduce_from_tensor_parallel_region_
from tp_train.parallel.layers import (
    SEQUENCE_SHARDED_INPUT,
    ColumnParallelLinear,
    RowParallelLinear,
    enter_column_parallel,
)


class ColumnParallelPointwiseConv(ColumnParallelLinear):
    """A 1x1 nn.Conv2d split by output channels: `ColumnParallelLinear` over the channels at dim 1 of an (N, C, H, W)
    input, its output this rank's channels. Its weight keeps Conv2d's (out, in, 1, 1) layout (a checkpoint's
    shapes are the unsharded model's). The input enters the parallel region whole (`f`); not with `gather_output`
    nor a sequence-sharded input."""

    feature_dim = 1

    def __init__(self, in_channels: int, out_channels: int, group: ProcessGroup, **kwargs):
        if kwargs.get("gather_output") or kwargs.get("pad_output"):
            raise ValueError("ColumnParallelPointwiseConv: gather_output is not supported; give it 'colwise'")
        super().__init__(in_channels, out_channels, group, overlap=False, **kwargs)
        self.weight = nn.Parameter(self.weight.detach()[..., None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_layout == SEQUENCE_SHARDED_INPUT:
            raise ValueError("ColumnParallelPointwiseConv takes a whole (N, C, H, W) input, not a sequence-sharded one")
        if self.input_region is not None:
            x = self.input_region.copy_to(x)
        else:
            x, _ = enter_column_parallel(x, self.group, self.input_layout, self.comm_counter)
        return F.conv2d(x, self.weight, self.bias)  # (N, out_channels / tp, H, W)


class RowParallelPointwiseConv(RowParallelLinear):
    """A 1x1 nn.Conv2d split by input channels: `RowParallelLinear` over the channels at dim 1 of an (N, C, H, W)
    input already split (a `ColumnParallelPointwiseConv`'s output); the partial outputs are all-reduced (`g`) and the
    bias, whole on every rank, added once after. Weight in Conv2d's (out, in, 1, 1) layout; none of
    `RowParallelLinear`'s other modes (split_input, scatter_output, sequence_parallel, partial_output)."""

    feature_dim = 1

    def __init__(self, in_channels: int, out_channels: int, group: ProcessGroup, **kwargs):
        unsupported = sorted(key for key in ("split_input", "scatter_output") if kwargs.get(key))
        if unsupported:
            raise ValueError(f"RowParallelPointwiseConv: {unsupported} not supported; give it 'rowwise'")
        super().__init__(in_channels, out_channels, group, **kwargs)
        self.weight = nn.Parameter(self.weight.detach()[..., None, None])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel or self.partial_output:
            raise ValueError("RowParallelPointwiseConv: sequence_parallel and partial_output are not supported")
        y = reduce_from_tensor_parallel_region_(F.conv2d(x, self.weight), self.group, self.comm_counter)
        return y.add_(self.bias.to(y.dtype)[:, None, None]) if self.bias is not None else y
