"""A model's own plan that shards some of its blocks but leaves Linears in them whole (Hugging Face plans that shard
only the MLP or the experts, saying nothing of attention) is completed by the auto-planner: attention is paired
head-aware, the plan's own entries stay as written, and the result matches the unsharded model at tp 2 and 4 with
each rank holding 1/tp of the block matrices. A plan passed as `plan=`, or one keeping a module whole
(`replicate`), is taken as it is."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL, VOCAB, SwiGLUModel, _logits
from tp_train.plan.deciding.autoplan import COMPLETED_SOURCE
from tp_train.plan.deciding.resolve import resolve_plan

MLP_ONLY = {
    "embed": "embedding_rowwise",
    "layers.*.mlp.gate_up": "packed_colwise",
    "layers.*.mlp.down": "rowwise",
    "head": "colwise_gather_output",
}


class MLPOnlyPlanModel(SwiGLUModel):
    """SwiGLUModel whose own plan shards only the MLP, as DeepSeek-V3's or Flint's Hugging Face plans do."""

    tp_plan = MLP_ONLY


def test_a_plan_sharding_only_the_mlp_gets_its_attention_paired():
    plan, source = resolve_plan(MLPOnlyPlanModel(), tensor_parallel_size=2)
    assert source == f"MLPOnlyPlanModel.tp_plan, {COMPLETED_SOURCE}"
    assert {key: plan[key] for key in MLP_ONLY} == MLP_ONLY  # its own entries, as written
    for name in ("q", "k", "v"):
        assert plan[f"layers.*.attn.{name}"] == "colwise"
    assert plan["layers.*.attn.out"] == "rowwise"
    assert not plan.notes


def test_a_passed_plan_or_one_keeping_attention_whole_is_taken_as_it_is():
    assert resolve_plan(MLPOnlyPlanModel(), MLP_ONLY, 2) == (MLP_ONLY, "the plan argument")
    model = MLPOnlyPlanModel()
    model.tp_plan = {**MLP_ONLY, "layers.*.attn": "replicate"}
    assert resolve_plan(model, tensor_parallel_size=2) == (model.tp_plan, "MLPOnlyPlanModel.tp_plan")


def _completed_parity(rank, world_size):
    torch.manual_seed(0)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        errors = parity_errors(MLPOnlyPlanModel(), _logits, VOCAB)
    return errors, printed.getvalue()


@pytest.mark.parametrize("tp", [2, 4])
def test_a_completed_plan_matches_unsharded_with_attention_sharded(tp):
    for rank, (errors, printed) in enumerate(run_on_ranks(_completed_parity, tp, timeout=300)):
        assert (COMPLETED_SOURCE in printed) == (rank == 0), printed
        assert_parity(errors, tp, rank, ATOL)  # block_rel_tol 0: each rank holds exactly 1/tp of the blocks
