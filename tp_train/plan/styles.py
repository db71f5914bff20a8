"""The plan vocabulary: what each style does, and the facts about modules every reader of a plan shares.

The styles, their arguments and parameter entries are described in docs/own-models.md ("Style reference")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.nn as nn

from tp_train.parallel.context_parallel.models import HEAD_ATTRIBUTES
from tp_train.parallel.sharding import ShardSpec

ROW_STYLES = {"rowwise", "rowwise_split_input", "rowwise_scatter_output"}
LINEAR_STYLES = ROW_STYLES | {"colwise", "colwise_gather_output", "packed_colwise", "fused_qkv_colwise"}
# A module reducing over split features: its parameters split as the parameter style `rowwise` splits them (their
# last dim), its reductions over the features completed (`tp_train.parallel.reductions`).
FEATURE_REDUCTION_STYLE = "feature_reduction_parallel"
# Styles that wrap a module's forward in collectives and swap nothing (see `tp_train.plan.applying.apply`).
REGION_STYLES = {"moe_tp_experts", "moe_identity_expert", "all_reduce", "mla_kv_a_proj"}
# Norms over features split across ranks, corrected to normalise as the unsharded norm does (`tp_train.parallel.norm`).
NORM_STYLES = ("rmsnorm_parallel", "gated_rmsnorm_parallel", "layernorm_parallel")
STYLES = LINEAR_STYLES | REGION_STYLES | {*NORM_STYLES, FEATURE_REDUCTION_STYLE, "embedding_rowwise", "attention"}
STYLES |= {"replicated_rng", "replicated_with_grad_allreduce", "replicate", "local_params", "channelwise"}
# Parameter styles that keep the parameter whole on every rank.
WHOLE_PARAMETER_STYLES = ("replicate", "replicate_once", "replicated_with_grad_allreduce")
PARAMETER_STYLES = {"channelwise", "colwise", "rowwise", "packed_colwise", "packed_rowwise", *WHOLE_PARAMETER_STYLES}
ALIASES = {"colwise_rep": "colwise_gather_output"}
PACKED_SECTIONS = {"packed_colwise": 2, "fused_qkv_colwise": 3}

# Attributes an attention module may keep that count its heads, or its width across heads (heads x head_dim); the
# query heads' (`HEAD_ATTRIBUTES`) are context parallelism's too, which cannot import the plan.
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head", "kv_heads")
KV_GROUP_ATTRIBUTES = ("num_key_value_groups", "num_kv_groups")  # query heads per kv head
WIDTH_ATTRIBUTES = ("split_size", "embed_dim", "all_head_size", "inner_dim")
# Config fields that hold head counts, checked whenever a model with such a config is sharded.
CONFIG_HEAD_FIELDS = HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES


@dataclass
class PlannedModule:
    name: str
    module: nn.Module
    style: str
    pattern: str
    arguments: str = ""  # what the style's parentheses held: `attention(n_head, ...)`, `fused_qkv_colwise(64,32,32)`
    parameters: dict[str, str] = field(default_factory=dict)  # entries naming its own parameters: name -> style
    counts: HeadCounts | None = None  # a column layer's attention's head counts, read before any is localised

    @property
    def written_style(self) -> str:
        """The style as a plan writes it, with its arguments (`colwise(64,64,1x16,1x16,8)`)."""
        return f"{self.style}({self.arguments})" if self.arguments else self.style


# The class each swapping style replaces; a subclass's own forward is kept around the sharded layer.
SWAPPED_BASES = {style: nn.Linear for style in LINEAR_STYLES} | {"embedding_rowwise": nn.Embedding}


def pattern_matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names, strict=True))


def adapted_model(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, model) of the model a peft wrapper holds (`PeftModel.get_base_model()`, a tuner's `model`), whose
    names the model's own plan is written in; None for anything else."""
    if not type(module).__module__.startswith("peft."):
        return None
    inner = module.get_base_model() if hasattr(type(module), "get_base_model") else module._modules.get("model")
    if not isinstance(inner, nn.Module) or inner is module:
        return None
    return next((name, child) for name, child in module.named_modules() if child is inner)


def adapted_base(module: nn.Module) -> nn.Module | None:
    """The layer a peft adapter layer wraps (LoRA's `base_layer`, beside its `lora_A` and `lora_B`), else None: a
    plan entry naming the adapter layer shards it as its base layer, adapters included
    (`tp_train.plan.applying.adapters`)."""
    return module._modules.get("base_layer") if isinstance(module._modules.get("lora_A"), nn.ModuleDict) else None


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of an nn.Linear or a Hugging Face Conv1D (or of the one an adapter layer wraps),
    else None."""
    if (base := adapted_base(module)) is not None:
        return linear_shape(base)
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.shape[0], module.weight.shape[1]
    return None


def pointwise_conv_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_channels, out_channels) of a 1x1 nn.Conv2d that is a matmul over the channels at dim 1 of an (N, C, H, W)
    input (stride 1, no padding or dilation, one group: SwiftFormer's and PoolFormer's MLPs), else None. A plan may
    give it `colwise` or `rowwise` (`tp_train.parallel.pointwise_conv.ColumnParallelPointwiseConv`), and the
    auto-planner pairs such convs as it pairs Linears, reading their channels last
    (`tp_train.plan.probe.channels_last`)."""
    if not isinstance(module, nn.Conv2d) or type(module).forward is not nn.Conv2d.forward:
        return None
    plain = module.stride == (1, 1) and module.dilation == (1, 1) and module.padding in ((0, 0), "valid")
    if module.kernel_size == (1, 1) and plain and module.groups == 1 and module.padding_mode == "zeros":
        return module.in_channels, module.out_channels
    return None


def matrix_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of a module a column or row style can swap: a Linear-like one (`linear_shape`) or a 1x1 Conv2d
    (`pointwise_conv_shape`)."""
    return linear_shape(module) or pointwise_conv_shape(module)


@dataclass(frozen=True)
class HeadCounts:
    """An attention's head counts, as its module (or else the model's config) states them before sharding."""

    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None


def config_value(config, field: str):
    """`config.field`, or None where the config has no such field or keeps it per layer (Gemma 4's `head_dim`, read
    as one value, raises transformers' AmbiguousGlobalPerLayerAttributeError: each attention module holds its own)."""
    try:
        return getattr(config, field, None)
    except RuntimeError:
        return None


def head_counts(attention: nn.Module | None, config) -> HeadCounts:
    """The head counts of `attention` (a planned projection's parent), from its own attributes first (Falcon's
    multi-query keeps `num_kv_heads = 1` while its config says otherwise), then from the model's `config`."""

    def first(names, default=None):
        found = (config_value(owner, name) for owner in (attention, config) for name in names)
        return next((value for value in found if isinstance(value, int)), default)

    heads, kv_heads = first(HEAD_ATTRIBUTES), first(KV_HEAD_ATTRIBUTES)
    hidden = first(("hidden_size",))
    return HeadCounts(heads, kv_heads, first(("head_dim",), hidden // heads if hidden and heads else None))


def column_layout(
    style: str, out_features: int, counts: HeadCounts | None = None, arguments: str = ""
) -> tuple[tuple[int, ...], tuple | None]:
    """The sections a column style splits a layer's output into (each split evenly) and the heads in each (None where
    they do not matter): named sections, one, two halves or [q; k; v] (k and v as wide as fewer kv heads); a `colwise`
    layer as wide as the kv heads is one section of `kv_heads` units, replicated when tp exceeds them."""
    named = section_sizes(arguments)
    sections = PACKED_SECTIONS.get(style, 1)
    heads, kv_heads, head_dim = (counts.heads, counts.kv_heads, counts.head_dim) if counts else (None, None, None)
    grouped = bool(heads and kv_heads and kv_heads < heads)
    layout = (out_features // sections,) * sections, None
    if style == "fused_qkv_colwise" and grouped:
        head_dim, remainder = divmod(out_features, heads + 2 * kv_heads)
        if not remainder:
            layout = (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), (heads, kv_heads, kv_heads)
    elif style == "colwise" and grouped and head_dim and out_features == kv_heads * head_dim:
        layout = (out_features,), (kv_heads,)
    if named and section_units(arguments):
        return named, section_units(arguments)
    if named and named != layout[0]:
        return named, None
    return layout


def row_layout(in_features: int, arguments: str = "") -> tuple[int, ...]:
    """The sections a row style splits a layer's input into, each split evenly across ranks: those its arguments
    name (`rowwise(8,8,8,8)`: CodeGen's out_proj, reading each rank's heads of each of its four [q; v; k] groups),
    else one."""
    return section_sizes(arguments) or (in_features,)


def style_shard_spec(
    style: str, module: nn.Module, param_name: str, counts: HeadCounts | None = None, arguments: str = ""
) -> ShardSpec | None:
    """How `style` splits `module`'s parameter `param_name`, in the layout of the parallel layer that replaces it
    (nn.Linear's (out, in); `transposed` when the module stores it the other way, as Conv1D does), or None when
    every rank holds it whole (a row layer's bias, a style that swaps nothing). `counts`: its attention's head
    counts, and the style's `arguments`, for the sections of a fused [q; k; v] projection and kv heads fewer than
    ranks (`column_layout`)."""
    module = adapted_base(module) or module  # an adapter layer's base Linear (`adapted_base`)
    if style == "embedding_rowwise":
        return ShardSpec(dim=0, sections=(module.num_embeddings,), padded=True) if param_name == "weight" else None
    if style in NORM_STYLES:  # its weight split with the features it normalises
        style = "channelwise"
    if style == "channelwise":  # one entry per channel along dim 0 (`tp_train.plan.channels`), by named sections
        sections = section_sizes(arguments) or (getattr(module, param_name).shape[0],)
        return ShardSpec(dim=0, sections=sections, units=section_units(arguments))
    shape = matrix_shape(module)
    if shape is None or style not in LINEAR_STYLES:
        return None
    in_features, out_features = shape
    transposed = linear_shape(module) is not None and not isinstance(module, nn.Linear) and param_name == "weight"
    if style == "rowwise_scatter_output" and param_name == "bias":  # added to this rank's share of the output
        return ShardSpec(dim=0, sections=(out_features,))
    if style in ROW_STYLES:
        sections = row_layout(in_features, arguments)
        return ShardSpec(dim=1, sections=sections, transposed=transposed) if param_name == "weight" else None
    padded = style == "colwise_gather_output"
    sections, units = column_layout(style, out_features, counts, arguments)
    return ShardSpec(dim=0, sections=sections, padded=padded, transposed=transposed, units=units)


def parameter_shard_spec(style: str, module: nn.Module, param_name: str) -> ShardSpec | None:
    """How a plan entry naming `module`'s parameter or buffer `param_name` splits it (see the module docstring), or
    None when every rank holds it whole. `colwise(32,32,32,32)` names sections of its dimension, each split evenly
    (DBRX's 2-D expert weights, every expert's rows one after another); where that dimension is not their total, the
    last one that is (Falcon-H1's (1, 1, width) `mup_vector`, split with in_proj's output). Raises `ValueError` for a
    style that cannot split it."""
    param = getattr(module, param_name)
    style, arguments = split_style(style)
    if style in WHOLE_PARAMETER_STYLES:
        return None
    rowwise = style in ("rowwise", "packed_rowwise")
    if style not in PARAMETER_STYLES or (rowwise and param.dim() < 2):
        raise ValueError(
            f"style '{style}' cannot split a {param.dim()}-D parameter; a parameter takes one of "
            f"{', '.join(sorted(PARAMETER_STYLES))} (rowwise ones need 2 or more dims)"
        )
    dim = param.dim() - 1 if rowwise else 0 if style == "channelwise" else max(param.dim() - 2, 0)
    named = section_sizes(arguments)
    if named and style == "colwise" and param.shape[dim] != sum(named):
        dim = next((d for d in reversed(range(param.dim())) if param.shape[d] == sum(named)), dim)
    size = param.shape[dim]
    if arguments and (style != "colwise" or not named or sum(named) != size):
        raise ValueError(
            f"style '{style}({arguments})' must be 'colwise' naming section sizes that add up to dim {dim} ({size}), "
            f"e.g. 'colwise({size // 2},{size - size // 2})'"
        )
    packed = style.startswith("packed_") and getattr(module, "is_concatenated", True)
    sections = named or ((size // 2, size - size // 2) if packed else (size,))
    return ShardSpec(dim=dim, sections=sections, units=section_units(arguments) if named else None)


def mla_rope_dim(config) -> int:
    """The width of the rotary key at the end of a latent attention's `kv_a_proj_with_mqa` output."""
    rope_dim = getattr(config, "qk_rope_head_dim", None)
    if not isinstance(rope_dim, int):
        where = type(config).__name__
        raise ValueError(f"style 'mla_kv_a_proj' needs the model config's qk_rope_head_dim; {where} has none")
    return rope_dim


STYLES_WITH_ARGUMENTS = ("attention", "fused_qkv_colwise", "colwise", "channelwise", "rowwise", "moe_tp_experts")
# Styles whose parentheses may name only section sizes (`colwise(64,64,16,16,8)`).
SECTIONED_STYLES = ("fused_qkv_colwise", "colwise", "channelwise")
# `rowwise(feeds_parallel_region)`: a row layer whose all-reduced output then enters a sharded region again not
# through a column layer (Mamba's x_proj, read by each rank's channels of the scan): its output gradient is
# all-reduced too (Megatron's f after its g).
FEEDS_PARALLEL_REGION = "feeds_parallel_region"


def split_style(style: str) -> tuple[str, str]:
    """A style's name and what its parentheses hold (`"fused_qkv_colwise(64,32,32)"` -> `("fused_qkv_colwise",
    "64,32,32")`); `""` when it has none."""
    name, paren, rest = style.partition("(")
    if not paren:
        return style, ""
    if name not in STYLES_WITH_ARGUMENTS or not rest.endswith(")"):
        raise ValueError(f"style '{style}': only {', '.join(STYLES_WITH_ARGUMENTS)} take arguments in parentheses")
    return name, rest[:-1]


def check_style(pattern: str, style: str) -> tuple[str, str]:
    """The name (aliases resolved) and arguments of plan entry `pattern`'s `style`; a one-line `ValueError` for a
    style tp_train does not know."""
    name, arguments = split_style(ALIASES.get(style, style))
    if name not in STYLES | PARAMETER_STYLES:
        known = ", ".join(sorted(STYLES | PARAMETER_STYLES))
        raise ValueError(f"plan entry '{pattern}': unknown style '{name}'; known styles: {known}")
    return name, arguments


def section_sizes(arguments: str) -> tuple[int, ...] | None:
    """The section sizes `fused_qkv_colwise(64,32,32)` or `channelwise(64,16,16)` names, or None (the style's own
    layout: equal thirds, one section). A section written `2x8` is 2 indivisible units of 8 (16 rows)."""
    if not arguments[:1].isdigit():
        return None
    return tuple(math.prod(int(factor) for factor in size.split("x")) for size in arguments.split(","))


def section_units(arguments: str) -> tuple[int | None, ...] | None:
    """The indivisible units of each named section: G for a section written `GxN` (Mamba2's B and C: `n_groups` groups
    of `state_size`, replicated over tp / G ranks each when tp exceeds G), None for a plain size; None when no
    section names units."""
    sizes = arguments.split(",") if arguments[:1].isdigit() else []
    units = tuple(int(size.split("x")[0]) if "x" in size else None for size in sizes)
    return units if any(unit is not None for unit in units) else None
