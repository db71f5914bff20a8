"""The auto-planner: infers a column/row tensor-parallel plan from one probe forward of the model, as data for
the plan readers (`match`, `apply`). Its phases are described in docs/planner.md ("The auto-planner's phases"). Its
probe runs with running-statistics norms holding the probe batch's statistics (`probe_statistics`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from tp_train.errors import first_line
from tp_train.plan.deciding.coverage import (
    as_patterns,
    covered_linears,
    in_repeated_block,
    kept_whole_notes,
    whole_beyond_small,
)
from tp_train.plan.deciding.locality import LocalityProbes
from tp_train.plan.deciding.pairs import (
    SPLIT_NORMS,
    SPLITS,
    TABLE_STYLE,
    UNSPLIT_WHOLE,
    WHOLE_SUMMED,
    Pair,
    enclosing_module,
    over_last_dim,
    per_feature,
)
from tp_train.plan.deciding.structure_rules import StructureRules
from tp_train.plan.deciding.views import AttentionViews
from tp_train.plan.probe import hooks_removed, probe_copy, producers_of, producers_of_calls, tensor_caches, trace_calls
from tp_train.plan.probe_input import ProbeInput, probe_input
from tp_train.plan.styles import linear_shape, matrix_shape

INFERRED_SOURCE = "inferred by the auto-planner"
COMPLETED_SOURCE = "completed by the auto-planner"  # a model's own plan that shards no block, filled in


class InferredPlan(dict):
    """A plan the auto-planner inferred: {pattern: style}, plus `notes`, one line per attention it kept whole."""

    def __init__(self, plan: dict[str, str], notes: list[str]):
        super().__init__(plan)
        self.notes = notes


def infer_plan(
    model: nn.Module, tensor_parallel_size: int | None = None, example_input=None, given: dict[str, str] | None = None
) -> dict[str, str]:
    """A plan {module-name pattern: style} for `model`, right at `tensor_parallel_size`, inferred from one probe forward
    on `example_input` (default: the model's own, `probe_input`); `given`: the model's own plan being completed.
    Raises a one-line `ValueError` naming the module when the structure is not one the planner can be sure of."""
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
    notes = kept_whole_notes(model, {**(given or {}), **styles}, planner.kept_whole)
    return InferredPlan(as_patterns(model, styles), notes)


def format_plan(plan: dict[str, str], source: str) -> str:
    """The plan as printed: one `pattern: style` line per entry, under where it came from, then its notes (an
    attention kept whole: which, why, and how much of the model is sharded)."""
    width = max((len(pattern) for pattern in plan), default=0)
    lines = [f"  {pattern:<{width}}  {style}" for pattern, style in plan.items()]
    return "\n".join([f"tensor-parallel plan ({source}):", *lines, *getattr(plan, "notes", [])])


class _Planner(LocalityProbes, StructureRules, AttentionViews):
    def __init__(self, model: nn.Module, inputs: ProbeInput, shares: int, given: dict[str, str]):
        self.model, self.inputs, self.shares, self.given = model, inputs, shares, given
        self.covered = covered_linears(model, given)
        self.modules = dict(model.named_modules())
        self.owner = {id(param): name for name, module in self.modules.items() for param in module.parameters(False)}
        self.parameter_names = {id(param): name for name, param in model.named_parameters(remove_duplicate=False)}
        self.calls = trace_calls(model, inputs)
        # Linear-like: nn.Linear, Conv1D, a 1x1 Conv2d (traced channels-last, `tp_train.plan.probe.channels_last`).
        called = sorted(self.calls, key=lambda name: self.calls[name].order)
        self.linears = [name for name in called if matrix_shape(self.modules[name]) is not None]
        self.embeddings = [name for name in called if isinstance(self.modules[name], nn.Embedding)]
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
        # to the others. LayerNorms only where their input is computed from Linear outputs alone (ESM C's q_norm):
        # one in the residual stream reads embeddings too, and held, it would make a Linear patch embedding (SigLIP
        # 2's, plus its position embedding) look like a column of the first block's projections.
        once = [name for name, call in self.calls.items() if call.calls == 1 and isinstance(call.input, torch.Tensor)]
        self.norms = {
            name: style
            for name in once
            if over_last_dim(self.modules[name], self.calls[name].input)
            for style, recognised in SPLIT_NORMS
            if recognised(self.modules[name]) and (style != "layernorm_parallel" or self._inside_region(outputs, name))
        }
        # Leaf modules called once, reading Linear outputs alone, whose parameters hold one entry per feature along
        # their last dim (GRN's (1, 1, 1, C) weight and bias): their reductions over the features are held in
        # perturbed probes too.
        self.reducers = {
            name for name in once if per_feature(self.modules[name]) and self._inside_region(outputs, name)
        }
        self.kept_whole: dict[str, str] = {}  # attention modules no local view makes right -> why
        self.unsplit: dict[str, Pair] = {}  # a Linear of a would-be pair no split makes local -> that pair
        self._observed: dict | None = None  # head counts the attentions' reshapes show, read when first needed

    def _inside_region(self, outputs: dict[int, str], name: str) -> bool:
        """Whether module `name`'s input is computed from Linear outputs alone, through no parameter but per-feature
        ones (another norm's weight; no embedding, no residual stream, no position embedding added as a parameter,
        as SigLIP 2's (positions, features) one is)."""
        producers, params = producers_of(self.calls[name].input, outputs)
        per_feature = all(set(param.shape[:-1]) <= {1} for param in params)
        return bool(producers) and producers <= set(self.linears) and per_feature

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
            if table.startswith(enclosing_module(pair) + ".")
        }
        views = self._local_views(pairs)
        for pair in pairs:
            enclosing = enclosing_module(pair) if self._on_local_heads(pair) else None
            if enclosing in self.kept_whole:
                styles[enclosing] = "replicate"  # graceful: the rest of the model is still sharded
                continue
            styles.update(pair.columns)
            for table in pair.tables:
                # Split with the heads where an attention computes its bias from it (T5's first layer); whole where
                # a model hands every layer the bias of all heads (MPNet's encoder), each rank's attention taking
                # its heads of it (a view), the table's gradient then summed over the ranks.
                split = table in self.split_tables
                styles[f"{table}.weight" if split else table] = TABLE_STYLE if split else WHOLE_SUMMED
            styles.update(pair.own)
            styles.update(dict.fromkeys(pair.shared_tables, WHOLE_SUMMED))
            styles.setdefault(pair.row, pair.row_style)
            styles.update(pair.channels)
            for name in pair.replicated:  # its replicated output re-enters a sharded region: f after its g
                styles[name] = "rowwise(feeds_parallel_region)"
            if pair.attention and not pair.channels:
                self._attention_styles(pair, styles, views.get(enclosing, "attention"))
            elif enclosing in views:  # per-channel modules inside an attention that keeps head counts
                self._attention_styles(pair, styles, views[enclosing])
            styles.update(dict.fromkeys(sorted(pair.between), WHOLE_SUMMED))
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

    def _pairs_feeding_only_their_rows(self) -> tuple[list[Pair], dict[str, str]]:
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

    def _pairs(self, banned: set[str]) -> tuple[list[Pair], dict[str, str]]:
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
            pair = Pair(row, replicated=replicated)
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
                    self.unsplit.update(dict.fromkeys(producers | {row}, Pair(row, dict.fromkeys(ordered, ""))))
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

    def _head(self) -> str | None:
        """The last Linear, when it maps to the token embedding's vocabulary (kept out of column/row pairs)."""
        if self.tokens is None or not self.linears or self.linears[-1] in self.untraced:
            return None
        head = self.linears[-1]
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


# For the probe, norms that keep running statistics (LeViT's BatchNorms) hold the probe batch's own statistics, as a
# training step would have them (their initial zeros and ones hide what a query does); restored after.


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
