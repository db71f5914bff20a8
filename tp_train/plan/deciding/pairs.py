"""The auto-planner's records and the small pure functions its phases share: a column/row `Pair` (what the pairing
phase found between a row layer and its column layers), the thresholds and styles the phases test against, and the
masks the locality probes perturb with (`tp_train.plan.deciding.locality`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from tp_train.parallel.norm import is_layer_norm, is_rms_norm
from tp_train.parallel.sharding import ShardSpec

SPLITS = (("colwise", 1), ("packed_colwise", 2), ("fused_qkv_colwise", 3))  # style, sections of the output
LEAK_TOLERANCE = 1e-4  # relative to the perturbation's effect inside the share
# An attention no split makes local is kept whole (noted) up to this fraction of its block's parameters, the rest of
# the block sharded (SwiftFormer's additive attention beside its 1x1 conv MLPs: 0.16 at the zoo's sizes); above it
# (an attention with no MLP beside it, heads no split divides) the planner refuses.
UNSPLIT_WHOLE = 0.25
# A per-head embedding table's weight (buckets, heads), split along its last dim with the heads (a parameter entry).
TABLE_STYLE = "rowwise"
# Norms the probes hold the statistic of, by the style that normalises them over every rank's features.
SPLIT_NORMS = (("rmsnorm_parallel", is_rms_norm), ("layernorm_parallel", is_layer_norm))
WHOLE_SUMMED = "replicated_with_grad_allreduce"  # whole on every rank, its gradient summed


@dataclass
class Pair:
    row: str
    columns: dict[str, str] = field(default_factory=dict)  # column module -> style
    attention: bool = False
    between: set[str] = field(default_factory=set)  # modules whose parameters act between columns and row
    replicated: set[str] = field(default_factory=set)  # earlier row layers whose (all-reduced) output feeds it
    channels: dict[str, str] = field(default_factory=dict)  # modules holding per-channel parameters -> style
    tables: set[str] = field(default_factory=set)  # per-head embedding tables feeding it (T5's relative bias)
    # parameters inside the attention split with its heads, by full name -> style: per-channel biases (DeBERTa's),
    # "colwise" along dim 0; per-head tables (Swin's relative_position_bias_table), "rowwise" along the last dim
    own: dict[str, str] = field(default_factory=dict)
    shared_tables: set[str] = field(default_factory=set)  # embedding tables all its heads read (SpeechT5's)
    refusal: str | None = None  # why it cannot be planned, raised if it is still a pair once the leaks are dropped
    row_sections: tuple[int, ...] | None = None  # sections of the row's input, each split evenly (CodeGen's groups)

    @property
    def row_style(self) -> str:
        sections = self.row_sections
        return f"rowwise({','.join(map(str, sections))})" if sections and len(sections) > 1 else "rowwise"


def last_dim(tensor: torch.Tensor | None) -> int:
    return tensor.shape[-1] if tensor is not None and tensor.dim() else 0


def arguments_shape(call) -> tuple:
    """The kinds of a probe call's arguments: each tensor's shape, None as None, anything else its type's name."""

    def kind(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        return None if value is None else type(value).__name__

    return tuple(map(kind, call.args)) + tuple((key, kind(value)) for key, value in sorted(call.kwargs.items()))


def first_mask(output: torch.Tensor, dim: int) -> torch.Tensor:
    """True at index 0 of `output`'s dimension `dim` (none where it is the features or shorter than 2)."""
    mask = torch.zeros_like(output, dtype=torch.bool)
    if dim < output.dim() - 1 and output.shape[dim] >= 2:
        mask.narrow(dim, 0, 1).fill_(True)
    return mask


def rank_mask(output: torch.Tensor, spec: ShardSpec, shares: int, share: int) -> torch.Tensor:
    """True on the features of `output`'s last dimension that rank `share` holds under `spec` (`share_mask`'s chunk
    of each section, or the whole unit a replicated section gives it)."""
    mask = torch.zeros(output.shape[-1], dtype=torch.bool)
    for piece in spec.slices(share, shares):
        mask[piece.start : piece.start + piece.real] = True
    return mask.expand_as(output).to(output.device)


def share_mask(output: torch.Tensor, sections: tuple[int, ...], shares: int, share: int) -> torch.Tensor:
    """True on rank `share`'s part of every section of `output`'s last dimension."""
    mask = torch.cat([(torch.arange(size) // (size // shares)) == share for size in sections])
    return mask.expand_as(output).to(output.device)


def over_last_dim(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm`'s weights are as wide as its input's last dim (not ConvNeXt's channels-first LayerNorm, which
    permutes its (B, C, H, W) input before normalising)."""
    return all(param.shape[-1] == x.shape[-1] for param in norm.parameters(recurse=False))


def per_feature(module: nn.Module) -> bool:
    """Whether `module` has no children and parameters, each of 2 or more dims all 1 but the last (one entry per
    feature along the last dim, broadcast over the others; 1-D ones are `channelwise`'s)."""
    params = list(module.parameters(recurse=False))
    per_feature = all(param.dim() >= 2 and set(param.shape[:-1]) == {1} for param in params)
    return bool(params) and per_feature and not any(True for _ in module.children())


def per_head(param: torch.Tensor, heads: int, channels: int) -> bool:
    """Whether `param` holds one slice per head: shaped (heads,), or ending in (heads, head_dim) where the heads'
    features are the row layer's `channels`."""
    if param.dim() == 1:
        return param.shape[0] == heads
    return channels % heads == 0 and tuple(param.shape[-2:]) == (heads, channels // heads)


def conv_per_head(module: nn.Module | None, heads: int) -> bool:
    """Whether `module` is a convolution over one channel per head, each its own group (in, out and groups all
    `heads`)."""
    conv = isinstance(module, nn.modules.conv._ConvNd)
    return conv and module.groups == module.in_channels == module.out_channels == heads


def numbered_away(name: str) -> str:
    """`name` with the number ending each part removed (`experts.expert_6.wi` -> `experts.expert_.wi`)."""
    return ".".join(part.rstrip("0123456789") for part in name.split("."))


def enclosing_module(pair: Pair) -> str:
    """The innermost module holding all of a pair's layers ('' for the model itself)."""
    names = [*pair.columns, pair.row]
    enclosing = names[0].rpartition(".")[0]
    while enclosing and not all(name.startswith(enclosing + ".") for name in names):
        enclosing = enclosing.rpartition(".")[0]
    return enclosing
