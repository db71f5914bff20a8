"""The auto-planner: infers a column/row tensor-parallel plan from a model's structure, as data for the plan
readers (`tp_train.plan.match`, `tp_train.plan.apply`).

It runs one probe batch through the model (a real copy when the model is on the meta device) and reads the
structure off what happened, not off class names:

1. **Dataflow.** The autograd graph of the probe forward tells, for every Linear-like module (nn.Linear, Hugging
   Face's Conv1D), which Linear or Embedding outputs its input was computed from, through any number of
   non-Linear operations. A module whose input comes from Linear outputs only (no embedding, no residual stream)
   is a candidate row layer; those producers are its column layers (q/k/v, gate/up, a fused qkv, an MLP's fc).
2. **Locality, at the tensor-parallel size.** Megatron's split is right exactly when rank r's share of the column
   layers' output feeds only rank r's share of the row layer's input. The planner checks that by perturbing each
   share in turn and watching which share of the row input moves, for the contiguous split (`colwise`), the split
   of two halves (`packed_colwise`, [gate; up]) and of three thirds (`fused_qkv_colwise`, [q; k; v]), and takes
   the first that holds. Heads are thereby respected: a split through a head, or a [q; k; v] split as one matrix,
   moves other shares and fails. An RMS norm or a LayerNorm between them (BitNet's sub-norms, ESM C's q_norm and
   k_norm) has its statistic held in these probes: it gets `rmsnorm_parallel` (`layernorm_parallel`), which
   normalises over every rank's features. So do the reductions over the features of a module with per-feature
   parameters along their last dim (ConvNeXt V2's GRN, a mean over the channels): it gets
   `feature_reduction_parallel`, which completes them by an all-reduce.
3. **Attention.** A pair whose perturbation at the first token moves later tokens mixes positions: it is
   attention, and the module enclosing the pair gets the `attention` style (local head counts, sharded dropout
   stream). Dropout modules inside it that run after the row layer get `replicated_rng`; modules whose
   parameters act between the column and row layers (a norm over each head, QK-norm) get
   `replicated_with_grad_allreduce`.
4. **Embedding and head.** The embedding that reads the token ids is `embedding_rowwise`; the last Linear, when it
   maps to that vocabulary, is `colwise_gather_output`.

Every Linear inside a repeated block (a numbered child, `layers.0`) must end up column or row; otherwise the
planner refuses with a one-line `ValueError` naming the module (give the model a `tp_plan`). Names are returned as
patterns (`layers.*.mlp.up`).

Limits: perturbations are run once per distinct block shape (by generic name and widths), and a model on the meta
device is probed on a full copy on the CPU; the structure between a column and a row layer is checked, the code
that runs it on local shapes is not (a hard-coded head count): that is what verification (`tp_train.plan.verify`),
on by default, is for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn

from tp_train.errors import first_line
from tp_train.parallel.norm import hold_statistic, is_layer_norm, is_rms_norm
from tp_train.parallel.reductions import held_reductions
from tp_train.parallel.sharding import ShardSpec
from tp_train.plan.caches import tensor_caches
from tp_train.plan.coverage import (
    as_patterns,
    covered_linears,
    generic,
    in_repeated_block,
    kept_whole_notes,
    whole_beyond_small,
)
from tp_train.plan.head_shapes import observed_counts
from tp_train.plan.local_search import capture_calls, find_local_view
from tp_train.plan.local_view import parse_attention_style
from tp_train.plan.probe import (
    channels_first,
    channels_last,
    foreign_readers,
    forward_without_cache,
    probe_copy,
    producers_of,
    producers_of_calls,
    split_sizes,
    trace_calls,
)
from tp_train.plan.probe_input import ProbeInput, probe_input
from tp_train.plan.running_statistics import probe_statistics
from tp_train.plan.styles import (
    FEATURE_REDUCTION_STYLE,
    HEAD_ATTRIBUTES,
    KV_HEAD_ATTRIBUTES,
    NORM_STYLES,
    WIDTH_ATTRIBUTES,
    column_layout,
    head_counts,
    linear_shape,
    matrix_shape,
    split_style,
)

INFERRED_SOURCE = "inferred by the auto-planner"
COMPLETED_SOURCE = "completed by the auto-planner"  # a model's own plan that shards no block, filled in
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
WHOLE_SUMMED = "replicated_with_grad_allreduce"  # a parameter entry: whole on every rank, its gradient summed


@dataclass
class _Pair:
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


class InferredPlan(dict):
    """A plan the auto-planner inferred: {pattern: style}, plus `notes`, one line per attention it kept whole."""

    notes: list[str]


class _Stop(Exception):
    """Ends a probe forward once the row layer's input is captured."""


def infer_plan(
    model: nn.Module,
    tensor_parallel_size: int | None = None,
    example_input=None,
    given: dict[str, str] | None = None,
) -> dict[str, str]:
    """A plan {module-name pattern: style} for `model`, inferred from its structure (see the module docstring).

    Args:
        model: the unsharded model; a model on the meta device is probed on a materialised copy.
        tensor_parallel_size: the tp the plan must be right for (default 2); shares are checked at this size.
        example_input: the probe input: a tensor, a tuple of positional or a dict of keyword arguments of the model's
            forward; default the model's own (`tp_train.plan.probe_input`): a Hugging Face model's config-shaped
            batch, else (1, 8) random token ids below every embedding's size.
        given: the model's own plan being completed (its entries win), counted as sharding what it names.

    Raises:
        ValueError: (one line, naming the module) when the structure is not one the planner can be sure of.
    """
    shares = max(tensor_parallel_size or 2, 2)
    with probe_copy(model) as probe:
        inputs = probe_input(probe, example_input)
        try:
            with probe_statistics(probe, inputs):
                planner = _Planner(probe, inputs, shares, given or {})
                styles = planner.styles()
        except ValueError:
            raise
        except Exception as error:  # noqa: BLE001 - a structure the planner does not understand is a refusal
            raise ValueError(
                f"the auto-planner cannot plan {type(model).__name__} ({first_line(error)}); "
                f"give the model a `tp_plan` (or pass plan=...)"
            ) from error
    plan = InferredPlan(as_patterns(model, styles))
    plan.notes = kept_whole_notes(model, {**(given or {}), **styles}, planner.kept_whole)
    return plan


def format_plan(plan: dict[str, str], source: str) -> str:
    """The plan as printed: one `pattern: style` line per entry, under where it came from, then its notes (an
    attention kept whole: which, why, and how much of the model is sharded)."""
    width = max((len(pattern) for pattern in plan), default=0)
    lines = [f"  {pattern:<{width}}  {style}" for pattern, style in plan.items()]
    return "\n".join([f"tensor-parallel plan ({source}):", *lines, *getattr(plan, "notes", [])])


class _Planner:
    def __init__(self, model: nn.Module, inputs: ProbeInput, shares: int, given: dict[str, str]):
        self.model, self.inputs, self.shares, self.given = model, inputs, shares, given
        self.covered = covered_linears(model, given)
        self.modules = dict(model.named_modules())
        self.owner = {id(param): name for name, module in self.modules.items() for param in module.parameters(False)}
        self.parameter_names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
        self.calls = trace_calls(model, inputs)
        # Linear-like: nn.Linear, Conv1D, a 1x1 Conv2d (traced channels-last, `tp_train.plan.probe.channels_last`).
        self.linears = [name for name in self._called() if matrix_shape(self.modules[name]) is not None]
        self.embeddings = [name for name in self._called() if isinstance(self.modules[name], nn.Embedding)]
        # A module whose output carries no autograd history (run under no_grad, detached, or not a tensor: a
        # module called only with keyword arguments is traced without it) shows no dataflow.
        self.untraced = {name for name in self.linears if getattr(self.calls[name].output, "grad_fn", None) is None}
        outputs = {  # every call's: a layer run on two inputs (Pegasus-X's q_proj on tokens and global tokens)
            id(getattr(output, "grad_fn", None)): name
            for name in self.linears + self.embeddings
            for output in self.calls[name].outputs
        }
        outputs.pop(id(None), None)
        self.producers = {name: producers_of_calls(self.calls[name].inputs, outputs) for name in self.linears}
        self._cache: dict[tuple, str | bool | None] = {}  # results per block shape, by generic names
        self._bases: dict[str, list[torch.Tensor]] = {}  # each row layer's unperturbed input, at each of its calls
        # RMS norms and LayerNorms called once, by style: their statistic is held in perturbed probes (their style
        # normalises over every rank's features), so one between a column and a row layer does not spread a share
        # to the others.
        self.norms = {
            name: style
            for name, call in self.calls.items()
            if call.calls == 1
            and isinstance(call.input, torch.Tensor)
            and _over_last_dim(self.modules[name], call.input)
            for style, recognised in SPLIT_NORMS
            if recognised(self.modules[name])
        }
        # Only LayerNorms whose input is computed from Linear outputs alone (ESM C's q_norm): one in the residual stream
        # reads embeddings too, and held, it would make a Linear patch embedding (SigLIP 2's, plus its position
        # embedding) look like a column of the first block's projections. RMS norms are held wherever they are, as
        # before.
        self.norms = {
            name: style
            for name, style in self.norms.items()
            if style != "layernorm_parallel" or self._inside_region(outputs, name)
        }
        # Leaf modules called once, reading Linear outputs alone, whose parameters hold one entry per feature along
        # their last dim (GRN's (1, 1, 1, C) weight and bias): their reductions over the features are held in
        # perturbed probes too.
        self.reducers = {
            name
            for name, call in self.calls.items()
            if call.calls == 1
            and isinstance(call.input, torch.Tensor)
            and _per_feature(self.modules[name])
            and self._inside_region(outputs, name)
        }
        self.kept_whole: dict[str, str] = {}  # attention modules no local view makes right -> why
        self.unsplit: dict[str, _Pair] = {}  # a Linear of a would-be pair no split makes local -> that pair
        self._observed: dict | None = None  # head counts the attentions' reshapes show, read when first needed

    def _inside_region(self, outputs: dict[int, str], name: str) -> bool:
        """Whether module `name`'s input is computed from Linear outputs alone, through no parameter but per-feature
        ones (another norm's weight; no embedding, no residual stream, no position embedding added as a parameter,
        as SigLIP 2's (positions, features) one is)."""
        producers, params = producers_of(self.calls[name].input, outputs)
        per_feature = all(set(param.shape[:-1]) <= {1} for param in params)
        return bool(producers) and producers <= set(self.linears) and per_feature

    def _called(self) -> list[str]:
        return sorted(self.calls, key=lambda name: self.calls[name].order)

    def styles(self) -> dict[str, str]:
        styles: dict[str, str] = {}
        self.tokens = self._token_embedding()
        self.head = self._head()
        pairs, failures = self._pairs_feeding_only_their_rows()
        pairs = [pair for pair in pairs if not self.covered & {pair.row, *pair.columns}]  # the given plan's entries win
        self.split_tables = {
            table
            for pair in pairs
            if pair.attention
            for table in pair.tables
            if table.startswith(_enclosing(pair) + ".")
        }
        views = self._local_views(pairs)
        for pair in pairs:
            enclosing = _enclosing(pair) if self._on_local_heads(pair) else None
            if enclosing in self.kept_whole:
                styles[enclosing] = "replicate"  # graceful: the rest of the model is still sharded
                continue
            styles.update(pair.columns)
            for table in pair.tables:
                # Split with the heads where an attention computes its bias from it (T5's first layer); whole where
                # a model hands every layer the bias of all heads (MPNet's encoder), each rank's attention taking
                # its heads of it (a view), the table's gradient then summed over the ranks.
                split = table in self.split_tables
                styles[f"{table}.weight" if split else table] = (
                    TABLE_STYLE if split else "replicated_with_grad_allreduce"
                )
            styles.update(pair.own)
            styles.update({table: "replicated_with_grad_allreduce" for table in pair.shared_tables})
            styles.setdefault(pair.row, pair.row_style)
            styles.update(pair.channels)
            for name in pair.replicated:  # its replicated output re-enters a sharded region: f after its g
                styles[name] = "rowwise(feeds_parallel_region)"
            if pair.attention and not pair.channels:
                self._attention_styles(pair, styles, views.get(enclosing, "attention"))
            elif enclosing in views:  # per-channel modules inside an attention that keeps head counts
                self._attention_styles(pair, styles, views[enclosing])
            for name in sorted(pair.between):
                styles[name] = "replicated_with_grad_allreduce"
        styles.update(self._uncalled_siblings(styles))
        if self.tokens is not None:
            styles[self.tokens] = "embedding_rowwise"
        if self.head is not None:
            styles[self.head] = "colwise_gather_output"
        for name in self.linears:
            if name in self.covered or any(name.startswith(whole + ".") for whole in self.kept_whole):
                continue
            if linear_shape(self.modules[name]) is None:  # a 1x1 Conv2d no pair takes stays whole, as any conv
                continue
            # Up to `SMALL_WHOLE` of its block (an MoE router beside experts the plan shards) may stay whole.
            unplanned = name not in styles and in_repeated_block(name)
            whole = whole_beyond_small(self.model, name, {**self.given, **styles}) if unplanned else 0
            if whole and self._stands_alone(name, styles):
                # A projection on its own (Swin's patch merging between stages): split by its input's features, each
                # rank multiplying its share, one all-reduce summing them, rather than held whole on every rank.
                styles[name] = "rowwise_split_input"
            elif whole and whole <= UNSPLIT_WHOLE and (attention := self._unsplit_attention(name, styles)):
                self.kept_whole[attention] = failures[name]  # as one no local view makes right: noted, not refused
                styles[attention] = "replicate"
            elif whole:
                shape = matrix_shape(self.modules[name])
                reason = failures.get(name, "its output reaches no Linear through position- and head-wise operations")
                reason += f" (left whole, its block would keep {whole:.0%} of its parameters whole on every rank)"
                raise ValueError(
                    f"the auto-planner cannot plan '{name}' ({type(self.modules[name]).__name__} {shape[0]}->"
                    f"{shape[1]}): {reason}; give the model a `tp_plan` (or pass plan=...) for this block"
                )
        return styles

    def _unsplit_attention(self, name: str, styles: dict[str, str]) -> str | None:
        """The attention module enclosing Linear `name`'s would-be pair that no split made local, when that pair mixes
        tokens (SwiftFormer's additive attention: its query normalised over the features, then summed over the
        tokens) and nothing inside it is planned: it is kept whole on every rank, as an attention no local view makes
        right is, and the rest of the model is still sharded. Else None (an MLP no split fits is refused)."""
        pair = self.unsplit.get(name)
        if pair is None or not pair.columns:
            return None
        enclosing = _enclosing(pair)
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
            key = _numbered_away(name)
            style = next((style for other, style in planned.items() if _numbered_away(other) == key), None)
            if style is not None and key != name:
                found[name] = style
        return found

    def _stands_alone(self, name: str, styles: dict[str, str]) -> bool:
        """Whether `name` is a projection on its own: the Linears of its own block that read its output take it
        whole, as column layers the plan splits or as projections that also read a row layer's (all-reduced)
        output (Swin's patch merging feeds the next stage; MobileBERT's bottlenecks feed query and key, the MLP and
        the block's output bottleneck through the residual; a fused qkv whose heads no split finds feeds only its
        block's output projection: refused), and its input is whole on every rank in the sharded model (traced, the
        same shape at every call, computed from no layer the plan splits by columns, not inside an attention running
        on local heads)."""
        call = self.calls[name]
        if name in self.untraced or len(call.shapes) > 1 or call.input is None:
            return False
        split = {other for other, style in styles.items() if style.startswith(("colwise", "packed_", "fused_"))}
        rows = {other for other, style in styles.items() if style.startswith("rowwise")}
        if any(reader not in split and not self.producers[reader][0] & rows for reader in self._readers_in_block(name)):
            return False
        local = [other for other, style in styles.items() if style.startswith("attention")]
        inside = any(name.startswith(attention + ".") for attention in local)
        return not inside and not self.producers[name][0] & split

    def _readers_in_block(self, name: str) -> list[str]:
        """The Linears of `name`'s repeated block whose input is computed from its output."""
        block = _block_of(name)
        return [other for other in self.linears if name in self.producers[other][0] and _block_of(other) == block]

    # ----------------------------------------------------------------------------------------- column/row pairs

    def _pairs_feeding_only_their_rows(self) -> tuple[list[_Pair], dict[str, str]]:
        """The column/row pairs, none of whose columns feeds a Linear besides its row layer: a pair with such a
        column is dropped, its row layer no longer taken as a row (ELECTRA's embedding projection, feeding the first
        block's query, key and value and its residual, is no column of the query), until none is left."""
        banned: set[str] = set()
        while True:
            pairs, failures = self._pairs(banned)
            rows = {pair.row: pair for pair in pairs}
            taken = {column for pair in pairs for column in pair.columns}
            leak = next(
                ((column, name) for name in self.linears for column in sorted(self.producers[name][0] & taken)
                 if name not in rows or column not in rows[name].columns),
                None,
            )  # fmt: skip
            if leak is None:
                refusal = next((pair.refusal for pair in pairs if pair.refusal), None)
                if refusal:
                    raise ValueError(refusal)
                return pairs, failures
            column, name = leak
            row = next(pair.row for pair in pairs if column in pair.columns)
            banned.add(row)
            failures[column] = f"its output feeds '{name}' besides its row layer '{row}', so it cannot be split"

    def _pairs(self, banned: set[str]) -> tuple[list[_Pair], dict[str, str]]:
        pairs, taken = [], set()
        failures = {name: "its output has no autograd graph in the probe forward (computed under no_grad, or "
                    "detached), so the planner cannot see where it goes" for name in self.untraced}  # fmt: skip
        for row in self.linears:
            producers, _ = self.producers[row]
            # Embeddings beside the columns (not the token embedding) are per-head tables, as T5's relative position
            # bias: split by heads with the columns; shared by rows (its bias is handed on to the later layers).
            tables = {name for name in producers if name in self.embeddings and name != self.tokens}
            producers = producers - tables
            from_linears_only = producers and producers <= set(self.linears)
            rows_done = {pair.row for pair in pairs}
            columns_done = {column: style for pair in pairs for column, style in pair.columns.items()}
            # An earlier row layer's output is replicated (all-reduced): it may feed this row's region as is (Mamba's
            # x_proj feeding the scan); an earlier column may feed it too, split as before (Mamba's in_proj).
            replicated = producers & rows_done if from_linears_only else set()
            if row in taken or row in banned or row == self.head or not from_linears_only or not producers - replicated:
                continue
            if (producers - replicated) & taken and not (replicated and producers - replicated <= set(columns_done)):
                continue
            if (producers | {row}) & self.untraced:
                continue
            pair = _Pair(row, replicated=replicated)
            for column in sorted(producers - replicated, key=lambda name: self.calls[name].order):
                style = self._split(column, row, frozenset(replicated))
                others = frozenset(producers - replicated - {column})
                if style is None and others:  # seen where the other columns' outputs are not all zero (xLSTM's gate)
                    style = self._split(column, row, frozenset(replicated), others)
                if style is None or columns_done.get(column, style) != style:
                    reason = (
                        f"no split of '{column}' ({', '.join(s for s, _ in SPLITS)}) at tp={self.shares} gives each "
                        f"rank a share of its output that feeds only that rank's share of '{row}' (heads that tp "
                        f"does not divide, or a fused layout it cannot determine)"
                    )
                    failures.update({name: reason for name in producers | {row}})
                    ordered = sorted(producers, key=lambda name: self.calls[name].order)  # as a pair's columns
                    self.unsplit.update(dict.fromkeys(producers | {row}, _Pair(row, dict.fromkeys(ordered, ""))))
                    break
                pair.columns[column] = style
            else:
                # Per-head tables split with the heads; a table shared by the heads (SpeechT5's relative key
                # positions, one column per feature of a head) stays whole on every rank, its gradient summed.
                frozen = frozenset(pair.columns)
                pair.tables = {table for table in tables if self._table_local(table, row, frozen)}
                pair.shared_tables = tables - pair.tables
                pair.attention = self._mixes_tokens(pair)
                pair.between, spanning = self._between(pair)
                self._own_channels(pair)
                self._per_head_tables(pair)
                self._own_whole(pair)
                spanning = [message for owner, message in spanning if owner in pair.between]
                # not a per-head table (LeViT's (heads, offsets) biases, as wide as the split): refused, unless the
                # pair is dropped for a column feeding another Linear (Perceiver's classification decoder: its
                # attention's output projection, read by the MLP through a LayerNorm beside the trainable query
                # added to it, also feeds the final layer)
                pair.refusal = next(iter(spanning), None)
                if self._counts_heads_beside_a_norm(pair):
                    reason = (
                        f"a norm between '{row}' and its column layers normalises over the split features in an "
                        f"attention that keeps head counts, which the planner cannot check together"
                    )
                    failures.update({name: reason for name in producers | {row}})
                    continue
                pairs.append(pair)
                taken |= set(pair.columns) | {row}
        return pairs, failures

    def _own_channels(self, pair: _Pair) -> None:
        """Per-channel biases held by the attention module or a module inside it (DeBERTa's q_bias and v_bias, added
        to each head's queries and values) keep the attention's style: they become entries of their own (`pair.own`,
        full parameter names), split with the channels. Only when they are all the pair has between its layers: a
        mixer's convolution, decays and state sizes (Mamba's) stay `channelwise`."""
        enclosing = _enclosing(pair)
        inside = all(owner == enclosing or owner.startswith(enclosing + ".") for owner in pair.channels)
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
        if all(split_style(style)[0] == "channelwise" for style in pair.channels.values()) and all(
            p.dim() == 1 for p in own.values()
        ):
            pair.channels, pair.own = {}, styles

    def _per_head_tables(self, pair: _Pair) -> None:
        """2-D parameters inside the attention whose last dim holds one column per head (Swin's and BEiT's
        relative_position_bias_table, indexed into a (heads, tokens, tokens) bias), or whose first holds one row per
        head (LeViT's attention_biases): split with the heads along that dim, as T5's embedding table is, instead of
        kept whole with summed gradients."""
        enclosing = _enclosing(pair)
        if not pair.attention or not enclosing:
            return
        # the head count the attention (or a module inside it: Swin's self-attention) keeps
        counts = (
            getattr(module, name, None) for module in self.modules[enclosing].modules() for name in HEAD_ATTRIBUTES
        )
        heads = next((count for count in counts if isinstance(count, int)), None)
        used = {id(param) for param in self.producers[pair.row][1]}
        for owner in sorted(pair.between):
            if heads is None or heads % self.shares or owner != enclosing and not owner.startswith(enclosing + "."):
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

    def _own_whole(self, pair: _Pair) -> None:
        """Parameters of the module holding the pair acting between its layers get entries of their own (`pair.own`),
        so that the module's other parameters are left as they are (VideoPrism's pooling query, read by the column
        layers, whose entry into the parallel region sums its gradient already: summed again it counted tp times) and
        an attention module keeps its `attention` style. One (heads, head width) per head, as many entries as the
        split features (a Conformer's relative-position biases pos_bias_u and pos_bias_v, added to each head's
        queries), is split with the heads along dim 0 (`colwise`); others act on every local head alike
        (VideoPrism's `per_dim_scale`, scaling each head's queries): whole, their gradients summed."""
        enclosing = _enclosing(pair)
        if not enclosing or enclosing not in pair.between:
            return
        used = {id(param) for param in self.producers[pair.row][1]}
        channels = _last_dim(self.calls[pair.row].input)
        pair.between.discard(enclosing)
        for name, param in self.modules[enclosing].named_parameters(recurse=False):
            if id(param) in used:
                per_head = param.dim() == 2 and param.numel() == channels and param.shape[0] % self.shares == 0
                pair.own[f"{enclosing}.{name}"] = "colwise" if per_head else WHOLE_SUMMED

    def _counts_heads_beside_a_norm(self, pair: _Pair) -> bool:
        """Whether `pair` is attention with a norm over split features between its layers whose enclosing module keeps
        head counts or widths: the local-view search (`tp_train.plan.local_search`), which simulates ranks without
        the norm's all-reduce, skips pairs with channels, so those counts would stay whole (MiniMax's lightning
        attention). An attention that views heads with -1 (BitNet's) needs no view."""
        if not pair.attention or not set(NORM_STYLES) & set(pair.channels.values()):
            return False
        module = self.modules.get(_enclosing(pair))
        names = HEAD_ATTRIBUTES + KV_HEAD_ATTRIBUTES + WIDTH_ATTRIBUTES
        return module is None or any(isinstance(getattr(module, name, None), int) for name in names)

    def _split(
        self, column: str, row: str, frozen: frozenset = frozenset(), background: frozenset = frozenset()
    ) -> str | None:
        """The first split of `column`'s output (`SPLITS`, or [q; k; v] of the sizes the row's view shows) whose
        shares feed only the same shares of `row`'s input (`_local`), or None. `background`: other columns of the row
        whose outputs are moved alike in every probe forward, so that one multiplying `column`'s output and zero in
        the probe (xLSTM's feed-forward gate, its weight initialised to zeros: silu(0) = 0) does not hide where
        `column`'s shares go."""
        width, row_width = _last_dim(self.calls[column].output), _last_dim(self.calls[row].input)
        if row_width % self.shares:
            return None
        key = ("split", generic(column), generic(row), width, row_width, tuple(sorted(map(generic, frozen))))
        key += tuple(sorted(map(generic, background)))
        if key not in self._cache:
            candidates = [(style, (width // sections,) * sections) for style, sections in SPLITS]
            # Unnamed, `fused_qkv_colwise` takes [q; k; v] from the head counts of the column's parent or the model's
            # config; thirds they do not give (LFM2's conv in_proj, [B; C; x], in a grouped-query model) are named.
            thirds = candidates[-1][1]
            parent = self.modules.get(column.rpartition(".")[0])
            counts = head_counts(parent, getattr(self.model, "config", None))
            if column_layout("fused_qkv_colwise", width, counts)[0] != thirds:
                candidates[-1] = (f"fused_qkv_colwise({','.join(map(str, thirds))})", thirds)
            sizes = split_sizes(self.calls[column].output, self.calls[row].input)
            if sizes and len(set(sizes)) > 1 and len(sizes) == 3:  # [q; k; v] of unequal sizes (grouped-query)
                candidates.append((f"fused_qkv_colwise({','.join(map(str, sizes))})", sizes))
            self._cache[key] = next(
                (
                    style
                    for style, sizes in candidates
                    if sum(sizes) == width
                    and all(size % self.shares == 0 for size in sizes)
                    and self._local(column, row, sizes, frozen, background=background)
                ),
                None,
            ) or self._replicated_kv_heads(column, row, frozen, background)
        return self._cache[key]

    def _replicated_kv_heads(self, column: str, row: str, frozen: frozenset, background: frozenset) -> str | None:
        """`colwise(KxD)` for a kv projection of K heads of width D, fewer than the ranks, as its attention's own
        reshape shows them (`tp_train.plan.head_shapes`): each head held whole by tp / K ranks, the ranks holding it
        those whose query heads read it; when perturbing each head moves only those ranks' shares of `row`'s input."""
        if self._observed is None:
            self._observed = observed_counts(self.model, self.linears, self.inputs)
        counts = self._observed.get(column)
        if counts is None or counts.kv_heads >= self.shares or self.shares % counts.kv_heads:
            return None
        if _last_dim(self.calls[column].output) != counts.kv_heads * counts.head_dim:
            return None
        spec = ShardSpec(dim=0, sections=(counts.kv_heads * counts.head_dim,), units=(counts.kv_heads,))
        local = self._local(column, row, spec, frozen, background=background)
        return f"colwise({counts.kv_heads}x{counts.head_dim})" if local else None

    def _local(
        self,
        column: str,
        row: str,
        sections: tuple[int, ...] | ShardSpec,
        frozen: frozenset = frozenset(),
        row_sections: tuple[int, ...] | None = None,
        background: frozenset = frozenset(),
    ) -> bool:
        """Whether perturbing rank r's share of `column`'s output (split in `sections`, each divided among the
        ranks) at every call moves only rank r's share of `row`'s input (of each of its `row_sections`, default
        one) at every call, for every r; the outputs of `frozen` modules (earlier row layers, all-reduced in the
        sharded model) held as they were. A layer run on two inputs (Pegasus-X's q_proj on the tokens and on the
        global tokens, BLIP-2's on queries and on text) is thereby checked as the one split the sharded model runs
        at each of its calls. `background`: modules whose outputs are moved alike in every one of these forwards
        (`_split`). A `ShardSpec` with sections of fewer units than ranks (kv heads) splits as `apply_plan` splits
        it: the ranks holding one replica are perturbed together and may all move."""
        spec = sections if isinstance(sections, ShardSpec) else ShardSpec(dim=0, sections=sections)
        copies = max(spec.replicas(self.shares))
        base = self._row_inputs(row, {}, frozen, background=background) if background else self._row_inputs(row, {})
        for share in range(0, self.shares, copies):
            mask = functools.partial(_rank_mask, spec=spec, shares=self.shares, share=share)
            moved = self._row_inputs(row, {column: mask}, frozen, background=background)
            if not self._moves_only(range(share, share + copies), base, moved, row_sections):
                return False
        return True

    def _moves_only(self, share, base: list[torch.Tensor], moved: list[torch.Tensor], row_sections=None) -> bool:
        """Whether a row layer's inputs at its calls, `base` before and `moved` after a perturbation, moved inside
        rank `share`'s share of their features (of each of `row_sections`, default one; `share` may be a range of
        ranks) only, and somewhere at all."""
        effects = [
            self._share_effect(after - before, share, row_sections) for before, after in zip(base, moved, strict=True)
        ]
        return max(effect for effect, _ in effects) > 0 and not any(leak > LEAK_TOLERANCE * e for e, leak in effects)

    def _share_effect(self, delta: torch.Tensor, share: int, sections=None) -> tuple[float, float]:
        """How far a row input moved inside rank `share`'s features (its chunk of each of `sections`), and outside
        them."""
        shares = share if isinstance(share, range) else (share,)
        masks = [_share_mask(delta, sections or (delta.shape[-1],), self.shares, each) for each in shares]
        inside = functools.reduce(torch.logical_or, masks)
        delta = delta.abs()
        outside = delta.masked_fill(inside, 0)
        return delta.masked_fill(~inside, 0).max().item(), outside.max().item()

    def _parameter_local(self, row: str, owner: str, param: torch.Tensor, dim: int) -> bool:
        """Whether perturbing rank r's share of `param` (of module `owner`) along `dim` moves only rank r's share of
        `row`'s input, for every r: its heads along that dim (a per-head table). The owner's tensor caches
        (`tp_train.plan.caches`) are emptied around each probe, so it computes from the perturbed values."""
        base = self._row_inputs(row, {})
        generator = torch.Generator(device=param.device).manual_seed(0)
        caches = tensor_caches(self.modules[owner])
        saved = [(cache, dict(cache)) for cache in caches]
        original = param.detach().clone()
        try:
            for share in range(self.shares):
                noise = torch.randn(param.shape, generator=generator, device=param.device, dtype=param.dtype)
                mask = _share_mask(param.movedim(dim, -1), (param.shape[dim],), self.shares, share).movedim(-1, dim)
                with torch.no_grad():
                    param.copy_(original + noise * (original.abs().mean() + 1e-3) * mask)
                for cache in caches:
                    cache.clear()
                if not self._moves_only(share, base, self._row_inputs(row, {}, fresh=True)):
                    return False
            return True
        finally:
            with torch.no_grad():
                param.copy_(original)
            for cache, contents in saved:
                cache.clear()
                cache.update(contents)

    def _table_local(self, table: str, row: str, columns: frozenset) -> bool:
        """Whether embedding `table`'s columns split evenly across ranks (its heads, one column each in T5's
        relative position bias) feed only the same rank's share of `row`'s input, the row's `columns` held: a table
        handed on to later layers also reaches them through the residual stream, which their columns read whole."""
        width = _last_dim(self.calls[table].output)
        return width % self.shares == 0 and self._local(table, row, (width,), columns)

    def _mixes_tokens(self, pair: _Pair) -> bool:
        """Whether a perturbation of the columns at the first token moves the row input at later tokens."""
        key = ("tokens", generic(pair.row), tuple(generic(name) for name in pair.columns))
        if key not in self._cache:
            self._cache[key] = self._perturbed_first_token_moves_later_ones(pair)
        return self._cache[key]

    def _perturbed_first_token_moves_later_ones(self, pair: _Pair) -> bool:
        """Whether perturbing the columns' outputs at one position (at every call) moves the row input (at a call)
        at more positions than one call perturbed: index 0 along each dimension but the features in turn (tokens are
        the second-to-last in most models, the first in time-major ones, LED's and FSMT's (T, B, C)). A batch
        dimension never mixes."""
        base = self._row_inputs(pair.row, {})
        outputs = [output for column in pair.columns for output in self.calls[column].outputs if output is not None]
        for dim in range(max(output.dim() for output in outputs) - 1):
            mask = functools.partial(_first_mask, dim=dim)  # a cross-attention's keys may be longer than its queries
            perturbed = max(int(mask(output).any(-1).sum()) for output in outputs)
            if not perturbed:
                continue
            moved = self._row_inputs(pair.row, dict.fromkeys(pair.columns, mask))
            pairs = zip(base, moved, strict=True)
            if max(int(((after - before).abs().amax(-1) > 0).sum()) for before, after in pairs) > perturbed:
                return True
        return False

    def _between(self, pair: _Pair) -> tuple[set[str], list[tuple[str, str]]]:
        """Modules whose parameters act between the columns and the row layer (summed gradients), and of those, the
        ones whose parameters span the split features, with the refusal due unless they prove per-head tables (no
        other existing style can shard them)."""
        split_widths = {_last_dim(self.calls[name].output) for name in pair.columns} | {
            _last_dim(self.calls[pair.row].input)
        }
        owners, spanning = set(), []
        channels = _last_dim(self.calls[pair.row].input)
        heads = self._attention_heads(pair)
        for param in self.producers[pair.row][1]:
            owner = self.owner.get(id(param), "?")
            if owner in self.reducers and param.shape[-1] == channels:
                pair.channels[owner] = FEATURE_REDUCTION_STYLE
                continue
            if heads and _conv_per_head(self.modules.get(owner), heads) and self._inside_attention(pair, owner):
                # A convolution with one group per head inside the attention (Nystromformer's depthwise conv over
                # each head's values): its weight and bias split with the heads along dim 0, its groups and
                # channels set to the local heads (`channelwise`).
                pair.own[owner] = "channelwise"
                continue
            if heads and _per_head(param, heads, channels) and self._inside_attention(pair, owner):
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

    def _columns_along_last_dim(self, pair: _Pair, owner: str, param: torch.Tensor) -> bool:
        """Whether `param`, a 2-D parameter of a module inside the attention, holds one column per channel of one of
        its column layers' outputs (split in one section), and perturbing rank r's share of those columns moves only
        rank r's share of the row input."""
        if (
            not pair.attention
            or param.dim() != 2
            or not self._inside_attention(pair, owner)
            or owner not in self.modules
        ):
            return False
        widths = {_last_dim(self.calls[column].output) for column, style in pair.columns.items() if style == "colwise"}
        local = param.shape[-1] in widths and param.shape[-1] % self.shares == 0
        return local and self._parameter_local(pair.row, owner, param, -1)

    def _column_of_channels(self, pair: _Pair, owner: str) -> str | None:
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
            width = _last_dim(self.calls[column].output)
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
        sections, heads = column_layout(base, _last_dim(self.calls[column].output), counts, arguments)
        if heads and all(heads):
            sizes = [f"{units}x{size // units}" for units, size in zip(heads, sections, strict=True)]
            return f"channelwise({','.join(sizes)})"
        return "channelwise" if len(sections) == 1 else f"channelwise({','.join(map(str, sections))})"

    def _attention_heads(self, pair: _Pair) -> int | None:
        """The head count of the attention enclosing `pair` when tp divides it: the first usual attribute of the
        module or a module inside it, else its config's (Funnel's `config.n_head`); None for no attention."""
        module = self.modules.get(_enclosing(pair)) if pair.attention and _enclosing(pair) else None
        if module is None:
            return None
        counts = (getattr(inner, name, None) for inner in module.modules() for name in HEAD_ATTRIBUTES)
        heads = next((count for count in counts if isinstance(count, int)), None)
        heads = heads or head_counts(module, getattr(self.model, "config", None)).heads
        return heads if heads and heads % self.shares == 0 else None

    def _on_local_heads(self, pair: _Pair) -> bool:
        """Whether `pair` is attention whose module is made to run on local heads (a view searched for, else kept
        whole): one with nothing split by channels between its layers, or, holding head counts, only per-channel
        modules inside it (Inkling's short convolutions over the keys and values, `channelwise`), which the search
        simulates split; searched for and found nothing, such a pair runs as a mixer does, with no view. A mixer
        with no head count (Mamba's, LFM2's convolution) or a norm over the split features is not searched."""
        if not pair.attention or not pair.channels:
            return pair.attention
        inside = all(self._inside_attention(pair, owner) for owner in pair.channels)
        plain = all(split_style(style)[0] == "channelwise" for style in pair.channels.values())
        return inside and plain and self._attention_heads(pair) is not None

    def _inside_attention(self, pair: _Pair, owner: str) -> bool:
        enclosing = _enclosing(pair)
        return owner == enclosing or owner.startswith(enclosing + ".")

    def _local_views(self, pairs: list[_Pair]) -> dict[str, str]:
        """The attention style of each attention module: the view under which it runs right on local heads
        (`tp_train.plan.local_search`), found once per block shape; modules with none go to `kept_whole`."""
        enclosing = {_enclosing(pair): pair for pair in pairs if self._on_local_heads(pair)}
        enclosing = {name: pair for name, pair in enclosing.items() if name and name in self.calls}
        if not enclosing:
            return {}
        # two copies of the batch: per-head tensors that fold in the batch show
        calls = capture_calls(self.model, self.inputs.doubled(), set(enclosing))
        views = {}
        for name, pair in enclosing.items():
            relative = {column[len(name) + 1 :]: style for column, style in pair.columns.items()}
            whole_tables = bool(pair.tables - self.split_tables)
            key = ("view", generic(name), tuple(sorted(relative.items())), _last_dim(self.calls[pair.row].input))
            key += (whole_tables, tuple(sorted((own[len(name) + 1 :], style) for own, style in pair.own.items())))
            key += (tuple(sorted((owner[len(name) + 1 :], style) for owner, style in pair.channels.items())),)
            # Not keyed by the split tables: T5's first layer computes the relative bias (its table inside it), the
            # later layers take it as an argument, whole in this probe but already their heads' once sharded; the
            # first layer's view holds for them.
            relative |= {table[len(name) + 1 :]: TABLE_STYLE for table in pair.tables if table.startswith(name + ".")}
            relative |= {own[len(name) + 1 :]: style for own, style in pair.own.items()}
            relative |= {owner[len(name) + 1 :]: style for owner, style in pair.channels.items()}
            row, config = pair.row[len(name) + 1 :], getattr(self.model, "config", None)
            search = partial(
                find_local_view,
                self.modules[name],
                calls[name],
                columns=relative,
                row=row,
                tp=self.shares,
                config=config,
            )
            called = key + (_arguments_shape(calls[name]),)
            if key not in self._cache:
                self._cache[key] = self._cache[called] = search()
            elif called not in self._cache:
                # A block passed other arguments (a mask, every second block: Donut-Swin's shifted windows) may read
                # a head count its neighbour never does: its own view, where one holds for its call that splits no
                # argument by heads (T5's later layers, handed the relative bias the first one computes, are whole
                # in this probe but their heads' once sharded: the first layer's view holds for them).
                found = search()
                view = parse_attention_style(found[0]) if found[0] else None
                self._cache[called] = found if found[0] and not (view and view.per_head) else self._cache[key]
            style, reason = self._cache[called]
            if style is None and not (pair.tables or pair.own or pair.replicated):
                grouped_key = ("grouped",) + called
                if grouped_key not in self._cache:
                    self._cache[grouped_key] = self._grouped_layout(name, pair, calls[name], search)
                style, columns, row_sections = self._cache[grouped_key] or (None, None, None)
                if style is not None:
                    pair.columns = {f"{name}.{column}": split for column, split in columns.items()}
                    pair.row_sections = row_sections
            if style is None and not pair.channels:
                self.kept_whole[name] = reason
            elif style is not None:  # none found for per-channel modules inside it: it runs as a mixer, no view
                views[name] = style
        return views

    def _grouped_layout(self, name: str, pair: _Pair, call, search) -> tuple[str, dict, tuple] | None:
        """For an attention no view makes right under its columns' first local split: its heads in G groups, as
        CodeGen keeps them (its forward reshapes qkv_proj's output into a hard-coded four groups of [q; v; k]), each
        rank holding its share of every group's heads: its row layer split by G sections of its input, each column
        by G, 2G or 3G sections (a group's q, v and k), each evenly. G from 2 up, as long as tp divides each group's
        heads; the first whose splits are local and under which a view holds. Its style, the columns' styles (by
        name relative to `name`) and the row's sections, or None."""
        heads, row_width = self._attention_heads(pair), _last_dim(self.calls[pair.row].input)
        frozen = frozenset(pair.replicated)
        for groups in range(2, (heads or 0) // self.shares + 1):
            if heads % (groups * self.shares) or row_width % (groups * self.shares):
                continue
            row_sections = (row_width // groups,) * groups
            columns = {}
            for column in pair.columns:
                width = _last_dim(self.calls[column].output)
                layouts = [(width // (k * groups),) * (k * groups) for k in (1, 2, 3) if width % (k * groups) == 0]
                sections = next(
                    (
                        layout
                        for layout in layouts
                        if layout[0] % self.shares == 0 and self._local(column, pair.row, layout, frozen, row_sections)
                    ),
                    None,
                )
                if sections is None:
                    break
                columns[column[len(name) + 1 :]] = f"colwise({','.join(map(str, sections))})"
            else:
                style, _ = search(columns=columns, row_sections=row_sections)
                if style is not None:
                    return style, columns, row_sections
        return None

    def _attention_styles(self, pair: _Pair, styles: dict[str, str], style: str) -> None:
        enclosing = _enclosing(pair)
        if not enclosing or enclosing not in self.calls:
            return  # no module of its own runs the attention (e.g. it lives in the block's forward)
        styles[enclosing] = style
        row_order = self.calls[pair.row].order
        for name, call in self.calls.items():
            after_row = call.order > row_order
            if name.startswith(enclosing + ".") and isinstance(self.modules[name], nn.Dropout) and after_row:
                styles[name] = "replicated_rng"  # e.g. resid_dropout: acts on the replicated output

    def _head(self) -> str | None:
        """The last Linear, when it maps to the token embedding's vocabulary (kept out of column/row pairs)."""
        if self.tokens is None or not self.linears:
            return None
        head = self.linears[-1]
        if head in self.untraced:
            return None
        return head if linear_shape(self.modules[head])[1] == self.modules[self.tokens].num_embeddings else None

    def _token_embedding(self) -> str | None:
        """The embedding reading the probe's token ids (an encoder-decoder's shared one reads the decoder's too)."""
        token_ids = [tensor for tensor in self.inputs.tensors() if not tensor.is_floating_point()]
        for name in self.embeddings:
            seen = self.calls[name].input
            if seen is not None and any(seen.shape == ids.shape and torch.equal(seen, ids) for ids in token_ids):
                module = self.modules[name]
                if module.max_norm is None and not module.sparse and not module.scale_grad_by_freq:
                    return None if self._weight_read_directly(module) else name
        return None

    def _weight_read_directly(self, embedding: nn.Embedding) -> bool:
        """Whether a module's forward reads `embedding`'s weight without calling it or a Linear tied to it
        (Perceiver's embedding decoder multiplies by `embedding_layer.weight.t()`, MobileBERT's head by
        `cat([decoder.weight.t(), dense.weight])`): split with the vocabulary, it would hand that forward the
        rank's rows only, so the embedding stays whole."""
        return bool(foreign_readers(self.model, self.inputs, embedding.weight))

    # ------------------------------------------------------------------------------------------- probe forwards

    def _row_inputs(
        self,
        row: str,
        masks: dict[str, Callable],
        frozen: frozenset = frozenset(),
        fresh: bool = False,
        background: frozenset = frozenset(),
    ) -> list[torch.Tensor]:
        """`row`'s input at each of its calls in a probe forward in which `masks[name](output)` marks entries of
        `name`'s output (at each of its calls) to perturb, and the outputs of `frozen` modules are held at their
        unperturbed values, and the outputs of `background` modules are moved by the same noise in every forward
        given them (`_split`); so is `row`'s own output (all-reduced, whole on every rank in the sharded model): a
        perturbation reaches a later call of it (ALBERT's one layer, run at every depth) only as its columns carry
        it there, not through the residual stream its earlier calls wrote. `fresh`: run again (a parameter was
        perturbed), not the unperturbed inputs kept."""
        if not masks and not fresh and not background and row in self._bases:
            return self._bases[row]
        frozen = frozen | {row} if masks or background else frozen
        captured = []
        generator = torch.Generator(device=self.calls[row].input.device).manual_seed(0)
        still = torch.Generator(device=self.calls[row].input.device).manual_seed(1)  # the background's, alike each time

        def perturb(module, args, output, mask, generator=generator):
            output = channels_last(module, output)  # as traced: a 1x1 conv's channels last
            scale = output.detach().abs().mean() + 1e-3
            noise = torch.randn(output.shape, generator=generator, device=output.device, dtype=output.dtype)
            return channels_first(module, output + noise * scale * mask(output))

        def capture(module, args):
            captured.append(channels_last(module, args[0]).detach().clone().float())
            if len(captured) == self.calls[row].calls:
                raise _Stop

        def held(name):
            outputs = iter(self.calls[name].outputs)
            return lambda module, args, output: channels_first(module, next(outputs).detach())

        handles = [self.modules[row].register_forward_pre_hook(capture)]
        handles += [
            self.modules[name].register_forward_hook(lambda m, a, o, mask=mask: perturb(m, a, o, mask))
            for name, mask in masks.items()
        ]
        handles += [
            self.modules[name].register_forward_hook(lambda m, a, o: perturb(m, a, o, torch.ones_like, still))
            for name in sorted(background)
        ]
        handles += [self.modules[name].register_forward_hook(held(name)) for name in frozen]
        # Norms and reductions hold their traced statistics in every probe forward, the unperturbed one too: a
        # forward without autograd may differ from the traced one by round-off (SeamlessM4T's conformer convolutions,
        # 6e-8), and a norm held in perturbed forwards only then moved every feature downstream of it.
        for name in self.reducers:
            enter, leave = held_reductions(self.modules[name], self.calls[name].input)
            handles += [self.modules[name].register_forward_pre_hook(enter)]
            handles += [self.modules[name].register_forward_hook(leave, always_call=True)]
        handles += [
            self.modules[name].register_forward_hook(
                lambda m, a, o, name=name: hold_statistic(m, a[0], o, self.calls[name].input)
            )
            for name in self.norms
        ]
        try:
            with torch.no_grad():
                forward_without_cache(self.model, self.inputs)
        except _Stop:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if not masks and not fresh and not background:
            self._bases[row] = captured
        return captured


# ------------------------------------------------------------------------------------------------------ helpers


def _last_dim(tensor: torch.Tensor | None) -> int:
    return tensor.shape[-1] if tensor is not None and tensor.dim() else 0


def _arguments_shape(call) -> tuple:
    """The kinds of a probe call's arguments: each tensor's shape, None as None, anything else its type's name."""

    def kind(value):
        if isinstance(value, torch.Tensor):
            return tuple(value.shape)
        return None if value is None else type(value).__name__

    return tuple(map(kind, call.args)) + tuple((key, kind(value)) for key, value in sorted(call.kwargs.items()))


def _first_mask(output: torch.Tensor, dim: int) -> torch.Tensor:
    """True at index 0 of `output`'s dimension `dim` (none where it is the features or shorter than 2)."""
    mask = torch.zeros_like(output, dtype=torch.bool)
    if dim < output.dim() - 1 and output.shape[dim] >= 2:
        mask.narrow(dim, 0, 1).fill_(True)
    return mask


def _rank_mask(output: torch.Tensor, spec: ShardSpec, shares: int, share: int) -> torch.Tensor:
    """True on the features of `output`'s last dimension that rank `share` holds under `spec` (`_share_mask`'s chunk
    of each section, or the whole unit a replicated section gives it)."""
    mask = torch.zeros(output.shape[-1], dtype=torch.bool)
    for piece in spec.slices(share, shares):
        mask[piece.start : piece.start + piece.real] = True
    return mask.expand_as(output).to(output.device)


def _share_mask(output: torch.Tensor, sections: tuple[int, ...], shares: int, share: int) -> torch.Tensor:
    """True on rank `share`'s part of every section of `output`'s last dimension."""
    mask = torch.cat([(torch.arange(size) // (size // shares)) == share for size in sections])
    return mask.expand_as(output).to(output.device)


def _over_last_dim(norm: nn.Module, x: torch.Tensor) -> bool:
    """Whether `norm`'s weights are as wide as its input's last dim (not ConvNeXt's channels-first LayerNorm, which
    permutes its (B, C, H, W) input before normalising)."""
    return all(param.shape[-1] == x.shape[-1] for param in norm.parameters(recurse=False))


def _per_feature(module: nn.Module) -> bool:
    """Whether `module` has no children and parameters, each of 2 or more dims all 1 but the last (one entry per
    feature along the last dim, broadcast over the others; 1-D ones are `channelwise`'s)."""
    params = list(module.parameters(recurse=False))
    per_feature = all(param.dim() >= 2 and set(param.shape[:-1]) == {1} for param in params)
    return bool(params) and per_feature and not any(True for _ in module.children())


def _per_head(param: torch.Tensor, heads: int, channels: int) -> bool:
    """Whether `param` holds one slice per head: shaped (heads,), or ending in (heads, head_dim) where the heads'
    features are the row layer's `channels`."""
    if param.dim() == 1:
        return param.shape[0] == heads
    return channels % heads == 0 and tuple(param.shape[-2:]) == (heads, channels // heads)


def _conv_per_head(module: nn.Module | None, heads: int) -> bool:
    """Whether `module` is a convolution over one channel per head, each its own group (in, out and groups all
    `heads`)."""
    conv = isinstance(module, nn.modules.conv._ConvNd)
    return conv and module.groups == module.in_channels == module.out_channels == heads


def _numbered_away(name: str) -> str:
    """`name` with the number ending each part removed (`experts.expert_6.wi` -> `experts.expert_.wi`)."""
    return ".".join(part.rstrip("0123456789") for part in name.split("."))


def _block_of(name: str) -> str:
    """The repeated block holding module `name`: its name up to the first numbered part (`layers.3`)."""
    parts = name.split(".")
    return ".".join(parts[: next((i for i, part in enumerate(parts) if part.isdigit()), len(parts)) + 1])


def _enclosing(pair: _Pair) -> str:
    """The innermost module holding all of a pair's layers ('' for the model itself)."""
    names = [*pair.columns, pair.row]
    enclosing = names[0].rpartition(".")[0]
    while enclosing and not all(name.startswith(enclosing + ".") for name in names):
        enclosing = enclosing.rpartition(".")[0]
    return enclosing
