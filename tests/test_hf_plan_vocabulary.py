"""Hugging Face's plan vocabulary beyond column/row Linears, with no plan passed:

- entries that name a parameter (transformers 5's fused 3-D MoE expert weights `experts.gate_up_proj` /
  `down_proj`, split per expert column-then-row; Llama4's transposed ones, `packed_rowwise`);
- `moe_tp_experts` (the router replicated, one all-reduce after the experts' sum);
- `colwise_gather_output` + `rowwise_split_input` inside blocks (olmo2's plan, for its norm over all heads);
- a head-aware plan in place of Hugging Face's where that one is wasteful (phi3's fused qkv_proj with fewer kv
  heads, and gate_up_proj), with the attention given a local copy of the config it reads head counts from;
- DeepSeek's latent attention (`mla_kv_a_proj`: the rotary key its replicated projection ends with enters the
  parallel region), with and without `q_lora_rank`;
- a tied LM-head bias (RoBERTa's `lm_head.bias`, the same parameter as `lm_head.decoder.bias`) split with the head;
- entries the config removed (Qwen2-MoE's dense MLP when every layer is sparse) skipped and reported, entries
  written without the base model's prefix (Llama4's text plan) resolved against it.

Each family matches the unsharded model at tp 2 and 4 (logits, gradients and 3 steps of losses within 1e-5), each
rank holding 1/tp of the block matrices, plus what stays whole on purpose: MoE routers (up to 3% more), DeepSeek's
latent projections (up to 30% more at this tiny width).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.distributed as dist

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors, parity_of_each
from tests.test_parallelize import ATOL, VOCAB
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import SKIPPED, resolve_plan

SIZES = dict(pad_token_id=0, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip

DEEPSEEK = dict(kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, moe_intermediate_size=32,
                n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1)  # fmt: skip

# model_type, config fields, where the plan comes from, and how far above 1/tp a rank's block share may be (the
# replicated routers of MoE models).
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "Hugging Face", 0.02),
    "qwen2_moe": (
        "qwen2_moe",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2),
        "with the built-in additions for model_type 'qwen2_moe'; " + SKIPPED,
        0.03,
    ),
    "llama4_text": (
        "llama4_text",
        dict(intermediate_size_mlp=64, num_local_experts=4, head_dim=8),
        "Hugging Face base_model_tp_plan; " + SKIPPED,
        0.02,
    ),
    "phi3": (
        "phi3",
        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=4),
        "the built-in head-aware plan for model_type 'phi3'",
        0.0,
    ),
    "olmo2": ("olmo2", {}, "Hugging Face", 0.0),
    # RoBERTa's causal LM: no plan, auto-planned; its head's bias is tied to lm_head.bias, which follows the shard.
    "roberta": (
        "roberta",
        dict(
            is_decoder=True,
            pad_token_id=1,
            type_vocab_size=1,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        ),
        "inferred by the auto-planner",
        0.0,
    ),
    # DeepSeek-V2's latent attention (`mla_kv_a_proj`), with and without a low-rank q (the entry for the q projection
    # its config does not build is skipped); its latent projections stay whole on every rank, as in HF's plan.
    "deepseek_v2": (
        "deepseek_v2",
        dict(DEEPSEEK, q_lora_rank=None),
        SKIPPED + " 'model.layers.*.self_attn.q_b_proj'",
        0.3,
    ),
    "deepseek_v2_q_lora": (
        "deepseek_v2",
        dict(DEEPSEEK, q_lora_rank=16),
        SKIPPED + " 'model.layers.*.self_attn.q_proj'",
        0.3,
    ),
}


def _build(model_type: str, fields: dict):
    from models.hf import hugging_face_causal_lm

    return hugging_face_causal_lm(model_type, config={**SIZES, **fields}).eval()


def _logits(model, idx):
    return model(idx).logits


def _parity_cases(rank, world_size):
    return parity_of_each({name: (partial(_build, *family[:2]), _logits) for name, family in FAMILIES.items()})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity_cases, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sharded_with_no_plan_given_matches_unsharded(parity_results, name):
    tp, results = parity_results
    for rank, result in enumerate(results):
        assert_parity(result[name], tp, rank, atol=ATOL, block_rel_tol=FAMILIES[name][3])


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_takes_its_plan_from_where_it_should(name):
    model_type, fields, source, _ = FAMILIES[name]
    plan, found = resolve_plan(_build(model_type, fields), tensor_parallel_size=2)
    assert source in found, found
    assert "\n" not in found


def test_entries_naming_parameters_split_them_and_their_module_wraps_the_experts():
    model = _build("mixtral", dict(num_local_experts=4))
    planned = {entry.name: entry for entry in match_plan(model, resolve_plan(model)[0], 2)}
    experts = planned["model.layers.0.mlp.experts"]
    assert experts.style == "moe_tp_experts"
    assert experts.parameters == {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
    assert "model.layers.0.mlp.gate" not in planned  # the router stays whole


def test_removed_entries_are_skipped_only_in_a_family_plan_not_in_one_given():
    model = _build("qwen2_moe", dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4))
    plan, source = resolve_plan(model)
    skipped = source.partition(SKIPPED)[2]
    assert skipped == " 'model.layers.*.mlp.gate_proj', 'model.layers.*.mlp.up_proj', 'model.layers.*.mlp.down_proj'"
    assert "model.layers.*.mlp.gate_proj" not in plan
    with pytest.raises(ValueError, match="plan entry 'model.layers.*.mlp.gate_proj' matches no module or parameter"):
        match_plan(model, {**plan, "model.layers.*.mlp.gate_proj": "colwise"}, 2)


def test_a_parameter_entry_with_a_style_that_cannot_split_it_is_a_one_line_error():
    model = _build("mixtral", dict(num_local_experts=4))
    plan = {**resolve_plan(model)[0], "model.layers.*.mlp.experts.down_proj": "embedding_rowwise"}
    with pytest.raises(ValueError) as error:
        match_plan(model, plan, 2)
    message = str(error.value)
    assert "\n" not in message
    assert "parameter 'model.layers.0.mlp.experts.down_proj' (4, 32, 64): style 'embedding_rowwise' cannot split" in (
        message
    )
    plan = {key: style for key, style in resolve_plan(model)[0].items() if ".experts." not in key}
    with pytest.raises(ValueError, match="'moe_tp_experts' but the plan shards none of its parameters"):
        match_plan(model, plan, 2)


def _wrong_packed_split(rank, world_size):
    """The negative control: Mixtral's [gate; up] expert weights split as one block, not half by half."""
    torch.manual_seed(0)
    model = _build("mixtral", dict(num_local_experts=4, num_experts_per_tok=2))
    plan = {**resolve_plan(model)[0], "model.layers.*.mlp.experts.gate_up_proj": "colwise"}
    # verify=False: parity alone must catch the wrong split (verification would refuse it first).
    return parity_errors(model, _logits, VOCAB, steps=1, parallelize_kwargs=dict(plan=plan, verify=False))["logits"]


@pytest.mark.slow
def test_a_wrong_split_of_fused_expert_weights_is_caught():
    error = run_on_ranks(_wrong_packed_split, 2)[0]
    assert error > 1e-3, error  # it runs, but computes something else


def _roberta_tie(rank, world_size):
    torch.manual_seed(0)
    model = tp_train.parallelize(_build(*FAMILIES["roberta"][:2]))
    state = tp_train.full_state_dict(model, dist.group.WORLD)
    head = model.lm_head
    return (
        head.bias is head.decoder.bias,
        tuple(head.bias.shape),
        torch.equal(state["lm_head.bias"], state["lm_head.decoder.bias"]),
    )


@pytest.mark.slow
def test_a_tied_head_bias_follows_the_head_shard():
    for tied, shape, equal in run_on_ranks(_roberta_tie, 2, timeout=300):
        assert tied and equal
        assert shape == (51,)  # 101 vocabulary rows padded to 102, 51 per rank


def _sequence_parallel_moe(rank, world_size):
    torch.manual_seed(0)
    try:
        tp_train.parallelize(_build(*FAMILIES["mixtral"][:2]), sequence_parallel=True)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_sequence_parallelism_refuses_styles_it_cannot_carry_in_one_line():
    message = run_on_ranks(_sequence_parallel_moe, 2, timeout=300)[0]
    assert "\n" not in message
    expected = "sequence_parallel does not support 'model.layers.0.mlp.experts' planned 'moe_tp_experts'"
    assert message.startswith(expected), message
