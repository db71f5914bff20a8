"""Attentions whose module holds more than its layers shard with no plan given and match the unsharded model at tp 2
and 4 (outputs, every gradient, three SGD losses): VideoPrism's pooling head, whose learned query enters through
q_proj (its gradient summed there) and whose `per_dim_scale` scales every local head's queries alike (kept whole, its
gradient summed by an entry of its own); Pegasus-X's global-local attention, whose q/k/v and out_proj run on the
tokens and again on the global tokens, at other shapes (the split is checked at every call of the pair); BLIP-2's
Q-Former, whose self-attention runs on the image queries and again on the text, and whose layers run the queries
and the text through MLPs of their own. Cohere ASR's Conformer attention, whose relative-position biases (one row per
head) are split with the heads, is checked by its plan (its convolution module, Conv1d layers, stays whole, so a rank
holds 0.87 of its block matrices at tp 2, beyond what `assert_parity` allows)."""

from __future__ import annotations

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity
from tests.test_any_transformer import models_parity
from tests.test_parallelize import ATOL
from tp_train.tools.zoo import build_family as build

MODELS = {  # name: (zoo task, family)
    "videoprism": ("dual-encoder", "videoprism"),
    "pegasus_x": ("seq2seq-lm", "pegasus_x"),
    "blip-2": ("dual-encoder", "blip-2"),
}


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(models_parity, request.param, MODELS, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_multi_role_attentions_match_unsharded_with_no_plan_given(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[name], tp, rank, ATOL)


def test_a_parameter_acting_on_local_heads_gets_an_entry_of_its_own():
    """VideoPrism's pooling head: `per_dim_scale` (one per feature of a head, on every head) is whole with its
    gradient summed; the module holding it gets no entry, so its pooling query, read by q_proj (which sums its
    gradient on entering the parallel region), is not summed a second time."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("dual-encoder", "videoprism"), tensor_parallel_size=2)
    assert plan["video_model.head.per_dim_scale"] == "replicated_with_grad_allreduce"
    assert "video_model.head" not in plan
    assert plan["video_model.head.q_proj"] == "colwise" and plan["video_model.head.o_proj"] == "rowwise"


def test_layers_run_twice_at_two_shapes_are_planned_as_one_split():
    """Pegasus-X's encoder attention runs q/k/v and out_proj on the tokens and on the global tokens: one column/row
    split, its view taking the local width where it reshapes by the input's."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("seq2seq-lm", "pegasus_x"), tensor_parallel_size=2)
    assert plan["model.encoder.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.encoder.layers.*.self_attn.out_proj"] == "rowwise"
    assert plan["model.encoder.layers.*.self_attn"] == "attention(num_heads, input_width)"


def test_per_head_biases_of_a_conformer_attention_are_split_with_its_heads():
    """Cohere ASR's encoder attention adds bias_u and bias_v, (heads, head width), to its queries: split along the
    heads, so the attention runs on local heads instead of being kept whole on every rank."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("speech-seq2seq", "cohere_asr"), tensor_parallel_size=2)
    assert plan["model.encoder.layers.*.self_attn.bias_u"] == "colwise"
    assert plan["model.encoder.layers.*.self_attn.bias_v"] == "colwise"
    assert plan["model.encoder.layers.*.self_attn"].startswith("attention")
    assert not plan.notes


def test_norms_held_in_every_probe_forward_leave_a_later_attention_plannable():
    """SeamlessM4T's conformer convolution feeds a LayerNorm the probes hold; a forward without autograd gives that
    norm an input 6e-8 off the traced one. Held in perturbed forwards only, the norm moved every feature after it,
    and the speech adapter's attention further on was refused ("no split of ... linear_q"); held in the unperturbed
    forward too, the adapter's attention is split by its heads."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("speech-seq2seq", "seamless_m4t"), tensor_parallel_size=2)
    assert plan["speech_encoder.adapter.layers.*.self_attn.linear_q"] == "colwise"
    assert plan["speech_encoder.adapter.layers.*.self_attn.linear_out"] == "rowwise"
    assert not plan.notes
