"""Parameters an attention keeps one slice per head of, beside its projections, are split with its heads: Funnel's
relative attention holds (heads, head_dim) biases, an (d_model, heads, head_dim) kernel and (2, heads, head_dim)
segment embeddings in the module that also runs its projections. With no plan given, the auto-planner splits each
along its heads dimension (a `colwise` parameter entry), the attention runs on local heads, and the sharded model
matches the unsharded one at tp 2 and 4."""

from __future__ import annotations

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity
from tests.test_any_transformer import models_parity
from tests.test_parallelize import ATOL
from tp_train.tools.zoo import build_family as build

MODELS = {"funnel": ("masked-lm", "funnel")}  # name: (zoo task, family)
PER_HEAD = {
    "funnel": [
        f"funnel.encoder.blocks.*.*.attention.{name}"
        for name in ("r_w_bias", "r_r_bias", "r_kernel", "r_s_bias", "seg_embed")
    ],
}


@pytest.mark.parametrize("name", list(PER_HEAD))
def test_per_head_parameters_are_split_with_the_heads(name):
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build(*MODELS[name]), tensor_parallel_size=2)
    assert {pattern: plan.get(pattern) for pattern in PER_HEAD[name]} == dict.fromkeys(PER_HEAD[name], "colwise")
    assert not plan.notes  # no attention kept whole


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(models_parity, request.param, MODELS, timeout=600)


@pytest.mark.parametrize("name", list(MODELS))
def test_families_with_per_head_parameters_match_unsharded(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[name], tp, rank, ATOL)
