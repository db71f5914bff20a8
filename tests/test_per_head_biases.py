"""Per-head biases built outside attention are sliced to each rank's heads: Bloom's ALiBi (built in the base
model's forward, `(batch * heads, 1, keys)`) and MPT's (`(heads, 1, keys)`). With no plan given, the auto-planner
finds where they enter attention, and the sharded model matches the unsharded one at tp 2 and 4."""

from __future__ import annotations

from functools import partial

import pytest

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_of_each
from tests.test_never_silently_wrong import _hf_family, _hf_logits
from tests.test_parallelize import ATOL

EXPECTED = {
    "bloom": ("transformer.h.*.self_attention", "attention(num_heads, alibi[0,batch])"),
    "mpt": ("transformer.blocks.*.attn", "attention(n_heads, position_bias[0])"),
}


@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_the_auto_planner_slices_the_per_head_bias(model_type):
    pattern, style = EXPECTED[model_type]
    assert tp_train.infer_plan(_hf_family(model_type), tensor_parallel_size=4)[pattern] == style


def _parity(rank, world_size):
    return parity_of_each({name: (partial(_hf_family, name), _hf_logits) for name in EXPECTED})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", list(EXPECTED))
def test_alibi_families_match_unsharded_with_no_plan_given(parity_results, model_type):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[model_type], tp, rank, ATOL)
