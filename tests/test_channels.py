"""Channel-wise parameters between a column and a row layer are split with the channels, so state-space blocks
shard column-then-row: Hugging Face's Mamba, with no plan given, is planned as Megatron shards Mamba (in_proj
[x; gate] by columns, conv1d, A_log, D and dt_proj by channels, x_proj by rows with its all-reduced output feeding
each rank's channels, out_proj by rows) and matches the unsharded model at tp 2 and 4. A per-channel scale between
an MLP's two layers is split the same way."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_of_each
from tests.test_autoplan import ScaledHidden, Unplanned
from tests.test_never_silently_wrong import _hf_family, _hf_logits
from tests.test_parallelize import ATOL

MAMBA_PLAN = {
    "backbone.embeddings": "embedding_rowwise",
    "backbone.layers.*.mixer": "channelwise",
    "backbone.layers.*.mixer.conv1d": "channelwise",
    "backbone.layers.*.mixer.in_proj": "packed_colwise",
    "backbone.layers.*.mixer.x_proj": "rowwise(feeds_parallel_region)",
    "backbone.layers.*.mixer.dt_proj": "colwise",
    "backbone.layers.*.mixer.out_proj": "rowwise",
    "lm_head": "colwise_gather_output",
}


@pytest.mark.parametrize("tp", [2, 4])
def test_the_auto_planner_shards_mamba_as_megatron_does(tp):
    torch.manual_seed(0)
    assert dict(tp_train.infer_plan(_hf_family("mamba"), tensor_parallel_size=tp)) == MAMBA_PLAN


def test_a_per_channel_scale_between_column_and_row_goes_with_the_channels():
    plan = tp_train.infer_plan(ScaledHidden(), tensor_parallel_size=2)
    assert plan["blocks.*"] == "channelwise" and plan["blocks.*.fc"] == "colwise" and plan["blocks.*.proj"] == "rowwise"


def _logits(model, idx):
    return model(idx)


MODELS = {
    "mamba": (partial(_hf_family, "mamba"), _hf_logits),
    "scaled_hidden": (lambda: Unplanned(ScaledHidden()), _logits),
}


def _parity(rank, world_size):
    return parity_of_each(MODELS)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity, request.param, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_channel_wise_blocks_match_unsharded_with_no_plan_given(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[name], tp, rank, ATOL)
