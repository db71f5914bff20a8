"""Structure rules no other test guarded, each on the tiny zoo family that needed it (docs/planner.md, "Rules and
their tests"): Switch Transformers' experts the probe's tokens never reach are split as their siblings are, and
MiniMax's lightning attention, an RMS norm over the split features inside an attention that keeps its head counts,
stays whole with a note rather than being split with its counts left whole."""

from __future__ import annotations

import pytest
import torch

import tp_train
from tests.test_planner_families import _family
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.tools.zoo import build_family


@pytest.mark.slow
def test_switch_experts_the_probe_never_reaches_are_split_like_their_siblings():
    """`_uncalled_siblings`: routing sends the probe's few tokens to some of the 8 experts only; the others are split
    as `expert_0` is, and the router stays whole."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build_family("seq2seq-lm", "switch_transformers"), tensor_parallel_size=2)
    experts = "encoder.block.*.layer.*.mlp.experts"
    missing = [f"expert_{n}" for n in range(8) if plan.get(f"{experts}.expert_{n}.wi") != "colwise"]
    assert not missing, f"experts left whole: {missing}"
    assert all(plan[f"{experts}.expert_{n}.wo"] == "rowwise" for n in range(8))
    assert not any("router" in pattern for pattern in plan)


def test_minimax_lightning_attention_with_a_norm_over_split_features_stays_whole_with_a_note():
    """`_counts_heads_beside_a_norm`: the local-view search cannot simulate the norm's all-reduce, so the lightning
    attention (layer 1, which keeps its head counts) is left whole, said in a note, and the softmax layers split."""
    plan, _ = resolve_plan(_family("minimax"), tensor_parallel_size=2)
    assert "model.layers.*.self_attn.qkv_proj" not in plan and "model.layers.*.self_attn.norm" not in plan
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert len(plan.notes) == 1 and "normalises over the split features" in plan.notes[0], plan.notes
