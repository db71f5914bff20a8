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


def test_sectioned_channelwise_keeps_each_ranks_share_of_every_section():
    """`channelwise(4,4,8)` on a depthwise conv1d over [q; k; v] of separate column layers: rank r keeps chunk r of
    q's, k's and v's channels, as the column layers hand it; the sections must add up and each split evenly."""
    from tp_train.parallel.sharding import shard_tensor
    from tp_train.plan.deciding.match import match_plan
    from tp_train.plan.styles import split_style, style_shard_spec

    conv = torch.nn.Conv1d(16, 16, kernel_size=3, groups=16, bias=False)
    style, arguments = split_style("channelwise(4,4,8)")
    spec = style_shard_spec(style, conv, "weight", arguments=arguments)
    channels = torch.arange(16.0).view(16, 1, 1)
    assert shard_tensor(channels, spec, 1, 2).flatten().tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    model = torch.nn.Sequential(conv)
    with pytest.raises(ValueError, match=r"sections \(4, 4, 4\) do not add up to weight.shape\[0\]=16"):
        match_plan(model, {"0": "channelwise(4,4,4)"}, 2)
    with pytest.raises(ValueError, match=r"weight.shape\[0\] section 0=5 is not divisible"):
        match_plan(model, {"0": "channelwise(5,3,8)"}, 2)


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
