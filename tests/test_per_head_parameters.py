"""Parameters an attention keeps one slice per head of, beside its projections, are split with its heads.

Funnel's relative attention holds (heads, head_dim) biases, an (d_model, heads, head_dim) kernel and (2, heads,
head_dim) segment embeddings in the module that also runs its projections: with no plan given, the auto-planner
splits each along its heads dimension (a `colwise` parameter entry) and the attention runs on local heads. NeoMME's
exclusive self-attention scales each head's correction by a per-head `alpha` and its value-embedding table feeds the
values of the global layers: Hugging Face's plan, which leaves both whole, gets them split with the heads (the table
by kv heads, each held by several ranks when fewer than tp), and its exclusive self-attention repeats the one local kv
head once per local query head. Each matches the unsharded model at tp 2 and 4 (NeoMME with 4 and 2 kv heads)."""

from __future__ import annotations

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity
from tests.test_any_transformer import models_parity
from tests.test_parallelize import ATOL
from tp_train.plan.resolve import resolve_plan
from tp_train.tools.zoo import build_family as build

MODELS = {  # name: (zoo task, family, config fields)
    "funnel": ("masked-lm", "funnel", {}),
    "neomme": ("masked-lm", "neomme", {}),
    "neomme_two_kv_heads": ("masked-lm", "neomme", {"num_key_value_heads": 2}),
}
# 2 kv heads at tp 4, each on two ranks (k_proj, v_proj and the value table): a rank holds 0.29 of the block matrices
REPLICATED = {"neomme_two_kv_heads": 0.2}
FUNNEL_PER_HEAD = [
    f"funnel.encoder.blocks.*.*.attention.{name}"
    for name in ("r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed")
]


def test_funnels_per_head_parameters_are_split_with_the_heads():
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("masked-lm", "funnel"), tensor_parallel_size=2)
    assert {pattern: plan.get(pattern) for pattern in FUNNEL_PER_HEAD} == dict.fromkeys(FUNNEL_PER_HEAD, "colwise")
    assert not plan.notes  # no attention kept whole


def test_neomme_splits_alpha_with_the_heads_and_its_value_table_with_the_kv_heads():
    torch.manual_seed(0)
    plan, _ = resolve_plan(build("masked-lm", "neomme", {"num_key_value_heads": 2}), tensor_parallel_size=4)
    assert plan["model.layers.*.self_attn.exclusive_self_attention.alpha"] == "colwise"
    assert plan["model.value_embeddings.weight"] == "colwise(2x16)"  # 2 kv heads of 16


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(models_parity, request.param, MODELS, timeout=600)


@pytest.mark.parametrize("name", list(MODELS))
def test_families_with_per_head_parameters_match_unsharded(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[name], tp, rank, ATOL, block_rel_tol=REPLICATED.get(name, 0.0) if tp == 4 else 0.0)
