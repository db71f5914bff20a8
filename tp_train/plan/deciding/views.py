"""The auto-planner's views phase: for each attention pair, the local view under which its module runs on local heads
(`local_search`), or why it is kept whole; and the styles of the attention and its dropout. Mixed into the planner."""

from __future__ import annotations

from functools import partial

import torch.nn as nn

from tp_train.plan.deciding.coverage import generic
from tp_train.plan.deciding.local_search import capture_calls, find_local_view
from tp_train.plan.deciding.pairs import TABLE_STYLE, Pair, arguments_shape, enclosing_module, last_dim
from tp_train.plan.local_view import kept_heads, parse_attention_style
from tp_train.plan.styles import head_counts, split_style


class AttentionViews:
    """The views phase (see the module docstring)."""

    def _attention_heads(self, pair: Pair) -> int | None:
        """The head count of the attention enclosing `pair` when tp divides it: the first usual attribute of the
        module or a module inside it, else its config's (Funnel's `config.n_head`); None for no attention."""
        module = self.modules.get(enclosing_module(pair)) if pair.attention and enclosing_module(pair) else None
        if module is None:
            return None
        heads = kept_heads(module) or head_counts(module, getattr(self.model, "config", None)).heads
        return heads if heads and heads % self.shares == 0 else None

    def _on_local_heads(self, pair: Pair) -> bool:
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

    def _inside_attention(self, pair: Pair, owner: str) -> bool:
        enclosing = enclosing_module(pair)
        return owner == enclosing or owner.startswith(enclosing + ".")

    def _local_views(self, pairs: list[Pair]) -> dict[str, str]:
        """The attention style of each attention module: the view under which it runs right on local heads
        (`tp_train.plan.deciding.local_search`), found once per block shape; modules with none go to `kept_whole`."""
        enclosing = {enclosing_module(pair): pair for pair in pairs if self._on_local_heads(pair)}
        enclosing = {name: pair for name, pair in enclosing.items() if name and name in self.calls}
        if not enclosing:
            return {}
        # two copies of the batch: per-head tensors that fold in the batch show
        calls = capture_calls(self.model, self.inputs.doubled(), set(enclosing))
        views = {}
        for name, pair in enclosing.items():
            relative = {column[len(name) + 1 :]: style for column, style in pair.columns.items()}
            whole_tables = bool(pair.tables - self.split_tables)
            key = ("view", generic(name), tuple(sorted(relative.items())), last_dim(self.calls[pair.row].input))
            key += (whole_tables, tuple(sorted((own[len(name) + 1 :], style) for own, style in pair.own.items())))
            key += (tuple(sorted((owner[len(name) + 1 :], style) for owner, style in pair.channels.items())),)
            # Not keyed by the split tables: T5's first layer computes the relative bias (its table inside it), the
            # later layers take it as an argument, whole in this probe but already their heads' once sharded; the
            # first layer's view holds for them.
            relative |= {table[len(name) + 1 :]: TABLE_STYLE for table in pair.tables if table.startswith(name + ".")}
            relative |= {own[len(name) + 1 :]: style for own, style in pair.own.items()}
            relative |= {owner[len(name) + 1 :]: style for owner, style in pair.channels.items()}
            search = partial(
                find_local_view,
                self.modules[name],
                calls[name],
                columns=relative,
                row=pair.row[len(name) + 1 :],
                tp=self.shares,
                config=getattr(self.model, "config", None),
            )
            called = key + (arguments_shape(calls[name]),)
            if key not in self._cache:
                self._cache[key] = self._cache[called] = search()
            elif called not in self._cache:
                # A block passed other arguments (a mask, every second block: Donut-Swin's shifted windows) may read
                # a head count its neighbour never does: its own view, where one holds for its call that splits no
                # argument by heads (T5's later layers, handed the relative bias: the first layer's, as said above).
                found = search()
                view = parse_attention_style(found[0]) if found[0] else None
                self._cache[called] = found if found[0] and not (view and view.per_head) else self._cache[key]
            style, reason = self._cache[called]
            if style is None and not (pair.tables or pair.own or pair.replicated):
                grouped_key = ("grouped",) + called
                if grouped_key not in self._cache:
                    self._cache[grouped_key] = self._grouped_layout(name, pair, search)
                style, columns, row_sections = self._cache[grouped_key] or (None, None, None)
                if style is not None:
                    pair.columns = {f"{name}.{column}": split for column, split in columns.items()}
                    pair.row_sections = row_sections
            if style is None and not pair.channels:
                self.kept_whole[name] = reason
            elif style is not None:  # none found for per-channel modules inside it: it runs as a mixer, no view
                views[name] = style
        return views

    def _attention_styles(self, pair: Pair, styles: dict[str, str], style: str) -> None:
        enclosing = enclosing_module(pair)
        if not enclosing or enclosing not in self.calls:
            return  # no module of its own runs the attention (e.g. it lives in the block's forward)
        styles[enclosing] = style
        for name, call in self.calls.items():
            dropout = name.startswith(enclosing + ".") and isinstance(self.modules[name], nn.Dropout)
            if dropout and call.order > self.calls[pair.row].order:
                styles[name] = "replicated_rng"  # e.g. resid_dropout: acts on the replicated output
