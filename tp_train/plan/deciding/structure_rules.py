"""The auto-planner's structure rules, each a method whose docstring names the family that needed it; mixed into the
planner. docs/planner.md ("Rules and their tests") lists each with the test that fails without it."""

from __future__ import annotations

import torch
import torch.nn as nn

from tp_train.plan.deciding.coverage import block_of, in_repeated_block
from tp_train.plan.deciding.pairs import (
    TABLE_STYLE,
    WHOLE_SUMMED,
    Pair,
    conv_per_head,
    enclosing_module,
    last_dim,
    numbered_away,
    per_head,
)
from tp_train.plan.local_view import kept_heads, usual_fields
from tp_train.plan.probe import foreign_readers
from tp_train.plan.styles import (
    FEATURE_REDUCTION_STYLE,
    NORM_STYLES,
    column_layout,
    head_counts,
    matrix_shape,
    split_style,
)


class StructureRules:
    """Rules for structures beside the column/row pairs (see the module docstring)."""

    def _unsplit_attention(self, name: str, styles: dict[str, str]) -> str | None:
        """The attention module enclosing Linear `name`'s would-be pair that no split made local, when that pair mixes
        tokens (SwiftFormer's additive attention: its query normalised over the features, then summed over the
        tokens) and nothing inside it is planned: it is kept whole on every rank, as an attention no local view makes
        right is, and the rest of the model is still sharded. Else None (an MLP no split fits is refused)."""
        pair = self.unsplit.get(name)
        if pair is None or not pair.columns:
            return None
        enclosing = enclosing_module(pair)
        planned = any(other.startswith(enclosing + ".") for other in styles)
        return enclosing if enclosing and not planned and self._mixes_tokens(pair) else None

    def _uncalled_siblings(self, styles: dict[str, str]) -> dict[str, str]:
        """Styles for the Linears the probe never ran that have a sibling it did, one name part apart by its number
        (the experts routing sent no probe token to: Switch Transformers' `experts.expert_6.wi`, as `expert_0.wi`):
        a layer of the same kind, split alike."""
        planned = {name: style for name, style in styles.items() if style in ("colwise", "rowwise")}
        found = {}
        for name, module in self.modules.items():
            if name in self.calls or matrix_shape(module) is None or not in_repeated_block(name):
                continue
            key = numbered_away(name)
            style = next((style for other, style in planned.items() if numbered_away(other) == key), None)
            if style is not None and key != name:
                found[name] = style
        return found

    def _stands_alone(self, name: str, styles: dict[str, str]) -> bool:
        """Whether `name` is a projection on its own: its block's Linears reading its output take it whole, and its
        input is whole on every rank (Swin's patch merging, MobileBERT's bottlenecks)."""
        call = self.calls[name]
        if name in self.untraced or len(call.shapes) > 1 or call.input is None:
            return False
        split = {other for other, style in styles.items() if style.startswith(("colwise", "packed_", "fused_"))}
        rows = {other for other, style in styles.items() if style.startswith("rowwise")}
        # the Linears of its repeated block whose input is computed from its output
        readers = [
            other for other in self.linears if name in self.producers[other][0] and block_of(other) == block_of(name)
        ]
        if any(reader not in split and not self.producers[reader][0] & rows for reader in readers):
            return False
        inside = any(name.startswith(other + ".") for other, style in styles.items() if style.startswith("attention"))
        return not inside and not self.producers[name][0] & split

    def _own_channels(self, pair: Pair) -> None:
        """Per-channel biases held by the attention module or a module inside it (DeBERTa's q_bias and v_bias, added
        to each head's queries and values) keep the attention's style: they become entries of their own (`pair.own`,
        full parameter names), split with the channels. Only when they are all the pair has between its layers: a
        mixer's convolution, decays and state sizes (Mamba's) stay `channelwise`."""
        inside = all(self._inside_attention(pair, owner) for owner in pair.channels)
        if not pair.attention or not pair.channels or not inside:
            return
        used = {id(param) for param in self.producers[pair.row][1]}
        own, styles = {}, {}
        for owner, style in pair.channels.items():
            module, arguments = self.modules[owner], split_style(style)[1]
            params = [(name, param) for name, param in module.named_parameters(recurse=False) if id(param) in used]
            width = params[0][1].shape[0] if params and params[0][1].dim() else None
            # its running statistics too (a BatchNorm's running_mean and running_var), split as its parameters are
            buffers = [(name, buffer) for name, buffer in module.named_buffers(recurse=False) if buffer.dim()]
            for name, tensor in params + buffers:
                if tensor.dim() and tensor.shape[0] == width and tensor.is_floating_point():
                    own[f"{owner}.{name}"] = tensor
                    styles[f"{owner}.{name}"] = f"colwise({arguments})" if arguments else "colwise"
        plain = all(split_style(style)[0] == "channelwise" for style in pair.channels.values())
        if plain and all(p.dim() == 1 for p in own.values()):
            pair.channels, pair.own = {}, styles

    def _per_head_tables(self, pair: Pair) -> None:
        """2-D parameters inside the attention whose last dim holds one column per head (Swin's and BEiT's
        relative_position_bias_table, indexed into a (heads, tokens, tokens) bias), or whose first holds one row per
        head (LeViT's attention_biases): split with the heads along that dim, as T5's embedding table is, instead of
        kept whole with summed gradients."""
        enclosing = enclosing_module(pair)
        if not pair.attention or not enclosing:
            return
        heads = kept_heads(self.modules[enclosing])
        used = {id(param) for param in self.producers[pair.row][1]}
        for owner in sorted(pair.between):
            if heads is None or heads % self.shares or not self._inside_attention(pair, owner):
                continue
            # (entries, heads): Swin's table, split along its last dim (`rowwise`); (heads, entries): LeViT's
            # attention_biases, indexed into a (heads, tokens, tokens) bias, along its first (`colwise`); whichever
            # the probe finds local (both of `heads` entries: LeViT's stage of 4 offsets and 4 heads)
            tables = {
                f"{owner}.{name}": style
                for name, param in self.modules[owner].named_parameters(recurse=False)
                if id(param) in used and param.dim() == 2
                for style, dim in (("rowwise", -1), ("colwise", 0))
                if param.shape[dim] == heads and self._parameter_local(pair.row, owner, param, dim)
            }
            if tables and len(tables) == sum(1 for p in self.modules[owner].parameters(recurse=False) if id(p) in used):
                pair.between.discard(owner)
                pair.own.update(tables)

    def _own_whole(self, pair: Pair) -> None:
        """Entries of their own (`pair.own`) for the pair module's parameters acting between its layers: per-head ones
        split with the heads (Conformer's pos_bias_u/v), the rest whole with summed gradients (VideoPrism's
        per_dim_scale)."""
        enclosing = enclosing_module(pair)
        if not enclosing or enclosing not in pair.between:
            return
        used = {id(param) for param in self.producers[pair.row][1]}
        channels = last_dim(self.calls[pair.row].input)
        pair.between.discard(enclosing)
        for name, param in self.modules[enclosing].named_parameters(recurse=False):
            if id(param) in used:
                per_head = param.dim() == 2 and param.numel() == channels and param.shape[0] % self.shares == 0
                pair.own[f"{enclosing}.{name}"] = "colwise" if per_head else WHOLE_SUMMED

    def _counts_heads_beside_a_norm(self, pair: Pair) -> bool:
        """Whether `pair` is attention with a norm over split features between its layers whose enclosing module keeps
        head counts or widths: the local-view search (`tp_train.plan.deciding.local_search`), which simulates ranks
        without the norm's all-reduce, skips pairs with channels, so those counts would stay whole (MiniMax's lightning
        attention). An attention that views heads with -1 (BitNet's) needs no view."""
        if not pair.attention or not set(NORM_STYLES) & set(pair.channels.values()):
            return False
        module = self.modules.get(enclosing_module(pair))
        return module is None or bool(usual_fields(module))

    def _between(self, pair: Pair) -> tuple[set[str], list[tuple[str, str]]]:
        """Modules whose parameters act between the columns and the row layer (summed gradients), and of those, the
        ones whose parameters span the split features, with the refusal due unless they prove per-head tables (no
        other existing style can shard them)."""
        owners, spanning = set(), []
        channels = last_dim(self.calls[pair.row].input)
        split_widths = {last_dim(self.calls[name].output) for name in pair.columns} | {channels}
        heads = self._attention_heads(pair)
        for param in self.producers[pair.row][1]:
            owner = self.owner.get(id(param), "?")
            if owner in self.reducers and param.shape[-1] == channels:
                pair.channels[owner] = FEATURE_REDUCTION_STYLE
                continue
            if heads and conv_per_head(self.modules.get(owner), heads) and self._inside_attention(pair, owner):
                # A convolution with one group per head inside the attention (Nystromformer's depthwise conv over
                # each head's values): its weight and bias split with the heads along dim 0, its groups and
                # channels set to the local heads (`channelwise`).
                pair.own[owner] = "channelwise"
                continue
            if heads and per_head(param, heads, channels) and self._inside_attention(pair, owner):
                # One slice per head inside the attention (Funnel's r_w_bias (heads, head_dim) and r_kernel
                # (d_model, heads, head_dim); NeoMME's exclusive-attention alpha (heads,)): split with the heads along
                # that dimension, as a parameter entry (`colwise` splits the second-to-last, a vector's only).
                pair.own[self.parameter_names[id(param)]] = "colwise"
                continue
            if param.dim() and param.shape[0] == channels and owner in self.modules:
                # One entry per channel of the row's input (an SSM's conv1d, A_log, D, dt_proj; a gated norm): split
                # with the channels (`channelwise`), or a Linear whose outputs are those channels (`colwise`), or an
                # norm over them, normalising over every rank's (`rmsnorm_parallel`, `layernorm_parallel`).
                shape = matrix_shape(self.modules[owner])
                pair.channels[owner] = "colwise" if shape is not None and shape[1] == channels else "channelwise"
                pair.channels[owner] = self.norms.get(owner, pair.channels[owner])
                continue
            if self._columns_along_last_dim(pair, owner, param):
                # One column per channel of a column's output, inside the attention (Inkling 2's dynamic short
                # convolutions: static taps (kernel, kv width) over k_proj's output), found local: split along it.
                pair.own[self.parameter_names[id(param)]] = TABLE_STYLE
                continue
            column = self._column_of_channels(pair, owner)
            if column is not None:
                # One entry per channel of a column's output, the column's split already found local (a norm with
                # per-channel statistics, LeViT's BatchNorm over q/k/v): split as the column splits its output.
                pair.channels[owner] = self._channels_like(column, pair.columns[column])
                continue
            if param.dim() and param.shape[-1] in split_widths:
                spanning.append((
                    owner,
                    f"the auto-planner cannot plan '{pair.row}': parameter of '{owner}' (shape {tuple(param.shape)}) "
                    f"acts on the features split between {sorted(pair.columns)} and it; give the model a `tp_plan`",
                ))  # fmt: skip
            owners.add(owner)
        mixed = sorted(owners & set(pair.channels))  # per-channel parameters beside others (Kimi's per-head A_log)
        if mixed:
            raise ValueError(
                f"the auto-planner cannot plan '{pair.row}': '{mixed[0]}' holds per-channel parameters beside others "
                f"no style splits with the channels; give the model a `tp_plan`"
            )
        return owners, spanning

    def _columns_along_last_dim(self, pair: Pair, owner: str, param: torch.Tensor) -> bool:
        """Whether `param`, a 2-D parameter of a module inside the attention, holds one column per channel of one of
        its column layers' outputs (split in one section), and perturbing rank r's share of those columns moves only
        rank r's share of the row input (Inkling 2's static short-convolution taps over k_proj's output)."""
        if not (pair.attention and param.dim() == 2 and self._inside_attention(pair, owner) and owner in self.modules):
            return False
        widths = {last_dim(self.calls[column].output) for column, style in pair.columns.items() if style == "colwise"}
        local = param.shape[-1] in widths and param.shape[-1] % self.shares == 0
        return local and self._parameter_local(pair.row, owner, param, -1)

    def _column_of_channels(self, pair: Pair, owner: str) -> str | None:
        """The column whose output `owner` acts on channel by channel: all its parameters one entry per channel of
        that output (1-D, as wide, or a depthwise convolution's (channels, 1, kernel) weight: Inkling's short
        convolutions over the keys and values, as wide as the kv heads), and no RMS norm (whose statistic the probes
        held, so locality did not check it)."""
        module = self.modules.get(owner)
        if module is None or owner in self.norms or matrix_shape(module) is not None:
            return None
        params = list(module.parameters(recurse=False))
        depthwise = isinstance(module, nn.modules.conv._ConvNd) and module.groups == module.in_channels
        for column in pair.columns:
            width = last_dim(self.calls[column].output)
            per_channel = (param.dim() == 1 or depthwise and module.groups == width for param in params)
            if params and all(param.shape[0] == width for param in params) and all(per_channel):
                return column
        return None

    def _channels_like(self, column: str, style: str) -> str:
        """The `channelwise` style splitting a per-channel module as `column`'s `style` splits its output: by the
        same sections (a fused [q; k; v] column's thirds), of the same heads (a k_proj's kv heads, `2x8`: held whole
        by the ranks sharing one when they are fewer than the ranks)."""
        base, arguments = split_style(style)
        parent = self.modules.get(column.rpartition(".")[0])
        counts = head_counts(parent, getattr(self.model, "config", None))
        sections, heads = column_layout(base, last_dim(self.calls[column].output), counts, arguments)
        if heads and all(heads):
            sizes = [f"{units}x{size // units}" for units, size in zip(heads, sections, strict=True)]
            return f"channelwise({','.join(sizes)})"
        return "channelwise" if len(sections) == 1 else f"channelwise({','.join(map(str, sections))})"

    def _grouped_layout(self, name: str, pair: Pair, search) -> tuple[str, dict, tuple] | None:
        """For an attention keeping its heads in G hard-coded groups (CodeGen's four [q; v; k] groups): each rank takes
        its share of every group; the attention style, the columns' styles and the row's sections, or None."""
        heads, row_width = self._attention_heads(pair), last_dim(self.calls[pair.row].input)
        frozen = frozenset(pair.replicated)
        for groups in range(2, (heads or 0) // self.shares + 1):
            if heads % (groups * self.shares) or row_width % (groups * self.shares):
                continue
            row_sections = (row_width // groups,) * groups
            columns = {}
            for column in pair.columns:
                width = last_dim(self.calls[column].output)
                layouts = [(width // (k * groups),) * (k * groups) for k in (1, 2, 3) if width % (k * groups) == 0]
                layouts = [layout for layout in layouts if layout[0] % self.shares == 0]
                local = (layout for layout in layouts if self._local(column, pair.row, layout, frozen, row_sections))
                sections = next(local, None)
                if sections is None:
                    break
                columns[column[len(name) + 1 :]] = f"colwise({','.join(map(str, sections))})"
            else:
                style, _ = search(columns=columns, row_sections=row_sections)
                if style is not None:
                    return style, columns, row_sections
        return None

    def _weight_read_directly(self, embedding: nn.Embedding) -> bool:
        """Whether a module's forward reads `embedding`'s weight without calling it or a Linear tied to it
        (Perceiver's embedding decoder multiplies by `embedding_layer.weight.t()`, MobileBERT's head by
        `cat([decoder.weight.t(), dense.weight])`): split with the vocabulary, it would hand that forward the
        rank's rows only, so the embedding stays whole."""
        return bool(foreign_readers(self.model, self.inputs, embedding.weight))
