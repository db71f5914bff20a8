"""Fewer kv heads than ranks where no config states the counts: the attention's own reshape shows them
(`tp_train.plan.deciding.head_shapes`), and the kv heads are replicated as a config's `num_key_value_heads` would have
them.

- A user's own grouped-query model (4 query heads, 2 kv heads of 16, `k.view(B, T, -1, head_dim)`, no head-count
  attribute) matches the unsharded model at tp=4, with a plain column/row plan and with no plan at all.
- A Hugging Face speech LLM whose counts live in a nested text config (Granite Speech's `text_config`) matches at
  tp=4 with 2 kv heads.
- Projections each in a wrapper of their own (Moshi's `k_proj.linear`) are counted among their attention's layers.
- What truly cannot split is still refused: 3 kv heads at tp=4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL
from tp_train.plan.deciding.head_shapes import observed_counts
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.styles import HeadCounts

VOCAB = 101
PLAIN_PLAN = {"blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise", "blocks.*.attn.v": "colwise",
              "blocks.*.attn.o": "rowwise", "blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}  # fmt: skip


class GroupedAttention(nn.Module):
    """Grouped-query attention that keeps only its head width: the kv heads are whatever k's width holds."""

    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.o = nn.Linear(width, width), nn.Linear(width, width)
        self.k, self.v = nn.Linear(width, kv_heads * self.head_dim), nn.Linear(width, kv_heads * self.head_dim)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (layer(x).view(B, T, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        groups = q.size(1) // k.size(1)  # query heads per kv head, read off the local shapes
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_dim)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, kv_heads: int):
        super().__init__()
        self.norm, self.attn = nn.LayerNorm(width), GroupedAttention(width, heads, kv_heads)
        self.fc, self.proj = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.proj(F.gelu(self.fc(x)))


class GroupedLM(nn.Module):
    def __init__(self, plan: dict | None = None, width: int = 64, heads: int = 4, kv_heads: int = 2):
        super().__init__()
        if plan is not None:
            self.tp_plan = plan
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.blocks = nn.ModuleList([Block(width, heads, kv_heads) for _ in range(2)])

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_the_reshape_shows_query_and_kv_heads():
    counts = observed_counts(GroupedLM(), ["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"])
    assert counts == dict.fromkeys(["blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v"], HeadCounts(4, 2, 16))
    planned = {entry.name: entry for entry in match_plan(GroupedLM(), PLAIN_PLAN, 4)}
    assert planned["blocks.1.attn.k"].counts == HeadCounts(4, 2, 16)
    with torch.device("meta"):  # read off shapes alone: no materialised copy of a model built on meta
        on_meta = GroupedLM()
    planned = {entry.name: entry for entry in match_plan(on_meta, PLAIN_PLAN, 4)}
    assert planned["blocks.1.attn.v"].counts == HeadCounts(4, 2, 16)
    assert all(param.is_meta for param in on_meta.parameters())


class Wrapper(nn.Module):
    """A projection's own wrapper around its Linear, as Moshi's `MoshiLinear` holds `.linear`."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def test_the_reshape_shows_the_heads_of_projections_each_in_a_wrapper():
    """Moshi's q, k and v are each `MoshiLinear(...).linear`: their parents differ, so the heads are counted among
    the layers of the module holding them all (the attention), not of each parent alone (which saw one layer each
    and found no kv heads: Moshi at tp=4 with 2 kv heads was refused)."""
    model = GroupedLM()
    for block in model.blocks:
        for name in ("q", "k", "v"):
            setattr(block.attn, name, Wrapper(getattr(block.attn, name)))
    columns = ["blocks.0.attn.q.linear", "blocks.0.attn.k.linear", "blocks.0.attn.v.linear"]
    assert observed_counts(model, columns) == dict.fromkeys(columns, HeadCounts(4, 2, 16))


def test_what_cannot_split_is_still_refused():
    with pytest.raises(ValueError, match="no split of 'blocks.0.attn.k'"):
        resolve_plan(GroupedLM(heads=12, kv_heads=3, width=96), tensor_parallel_size=4)


def _parity(rank, world_size):
    results = {}
    for name, plan in (("plain_plan", PLAIN_PLAN), ("no_plan", None)):
        torch.manual_seed(0)
        results[name] = parity_errors(GroupedLM(plan), lambda model, idx: model(idx), VOCAB)
    return results


@pytest.mark.slow
def test_own_grouped_query_model_at_tp4_matches_unsharded():
    for rank, results in enumerate(run_on_ranks(_parity, 4, timeout=300)):
        for errors in results.values():
            assert_parity(errors, 4, rank, ATOL, block_rel_tol=0.15)  # k and v held 1/2 per rank


@pytest.mark.slow
def test_nested_config_family_at_tp4_with_2_kv_heads_matches_unsharded():
    from tp_train.tools.zoo import run_zoo

    fields = {"num_key_value_heads": 2}
    result = run_zoo(["granite_speech"], 4, 1, 300, lambda line: None, "speech-seq2seq", fields)["granite_speech"]
    assert result["class"] == "pass", result
