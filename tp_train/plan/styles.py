"""The plan vocabulary: what each style does, and the facts about modules every reader of a plan shares.

A plan maps module-name patterns to style names. Patterns are dotted module names in which `*` stands for any
one name component (`"blocks.*.attn.q"`). Style names follow Hugging Face's vocabulary where it has one:

| style                   | module              | what happens                                                     |
|-------------------------|---------------------|------------------------------------------------------------------|
| `colwise`               | Linear / HF Conv1D  | `ColumnParallelLinear`, output sharded (heads, MLP hidden)       |
| `colwise_gather_output` | Linear / HF Conv1D  | `ColumnParallelLinear`, output gathered (an LM head); vocab padded |
| `rowwise`               | Linear / HF Conv1D  | `RowParallelLinear`, input sharded, output all-reduced           |
| `packed_colwise`        | Linear / HF Conv1D  | column split of a packed `[gate; up]` projection, half by half   |
| `fused_qkv_colwise`     | Linear / HF Conv1D  | column split of a fused `[q; k; v]` projection, head-aware       |
| `embedding_rowwise`     | Embedding           | `VocabParallelEmbedding`, vocab rows sharded and padded          |
| `attention`             | attention module    | head-count attributes set to the local heads; its dropout draws  |
|                         |                     | from the per-rank (sharded) random stream                        |
| `replicated_rng`        | any module          | dropout inside draws from the replicated stream again            |
| `replicated_with_grad_allreduce` | any module | its parameters stay whole; their gradients are summed over the TP |
|                         |                     | group (a norm applied to each rank's local heads, e.g. QK-norm)  |
| `replicate`             | any module          | left as it is (every rank holds it whole)                        |
| `channelwise`           | any module          | its own parameters split along dim 0 with the channels of the    |
|                         |                     | column layer before it (an SSM's conv1d, A_log, D; a gated norm) |

Two styles take arguments in parentheses: `fused_qkv_colwise(64,32,32)` names unequal [q; k; v] sections (grouped-query
attention's fused projection, litgpt's), and `attention(n_head, config.n_query_groups, input_width, ...)` names where
the module keeps its head counts (`tp_train.plan.local_view`).

`colwise_rep` is accepted as Hugging Face's older name for `colwise_gather_output`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tp_train.parallel.sharding import ShardSpec

LINEAR_STYLES = {"colwise", "colwise_gather_output", "rowwise", "packed_colwise", "fused_qkv_colwise"}
STYLES = LINEAR_STYLES | {
    "embedding_rowwise",
    "attention",
    "replicated_rng",
    "replicated_with_grad_allreduce",
    "replicate",
    "channelwise",
}
ALIASES = {"colwise_rep": "colwise_gather_output"}
PACKED_SECTIONS = {"packed_colwise": 2, "fused_qkv_colwise": 3}

# Attributes an attention module may keep that count its heads, or its width across heads (heads x head_dim).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "n_kv_head")
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


# The class each swapping style replaces; a subclass's own forward is kept around the sharded layer.
SWAPPED_BASES = {style: nn.Linear for style in LINEAR_STYLES} | {"embedding_rowwise": nn.Embedding}


def pattern_matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names, strict=True))


def linear_shape(module: nn.Module) -> tuple[int, int] | None:
    """(in_features, out_features) of an nn.Linear or a Hugging Face Conv1D, else None."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    if type(module).__name__ == "Conv1D" and getattr(module, "weight", None) is not None:
        return module.weight.shape[0], module.weight.shape[1]
    return None


def style_shard_spec(style: str, module: nn.Module, param_name: str) -> ShardSpec | None:
    """How `style` splits `module`'s parameter `param_name`, in the layout of the parallel layer that replaces it
    (nn.Linear's (out, in); `transposed` when the module stores it the other way, as Conv1D does), or None when
    every rank holds it whole (a row layer's bias, a style that swaps nothing)."""
    if style == "embedding_rowwise":
        return ShardSpec(dim=0, sections=(module.num_embeddings,), padded=True) if param_name == "weight" else None
    shape = linear_shape(module)
    if shape is None or style not in LINEAR_STYLES:
        return None
    in_features, out_features = shape
    transposed = not isinstance(module, nn.Linear) and param_name == "weight"
    if style == "rowwise":
        return ShardSpec(dim=1, sections=(in_features,), transposed=transposed) if param_name == "weight" else None
    sections = PACKED_SECTIONS.get(style, 1)
    padded = style == "colwise_gather_output"
    return ShardSpec(dim=0, sections=(out_features // sections,) * sections, padded=padded, transposed=transposed)


STYLES_WITH_ARGUMENTS = ("attention", "fused_qkv_colwise", "rowwise")
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


def section_sizes(arguments: str) -> tuple[int, ...] | None:
    """The section sizes `fused_qkv_colwise(64,32,32)` names, or None (equal thirds)."""
    return tuple(int(size) for size in arguments.split(",")) if arguments[:1].isdigit() else None
