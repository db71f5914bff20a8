"""Parity of the built-in presets for Hugging Face families whose configs ship no `base_model_tp_plan` (GPT-J,
GPT-Neo, OPT, Falcon): tiny randomly initialised models, sharded at tp 1, 2 and 4, against the unsharded model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL, VOCAB, _hf_logits


def _hf_gptj():
    from transformers import GPTJConfig, GPTJForCausalLM

    config = GPTJConfig(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPTJForCausalLM(config)


def _hf_gpt_neo():
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        vocab_size=VOCAB, max_position_embeddings=32, hidden_size=32, num_layers=2, num_heads=4,
        attention_types=[[["global", "local"], 1]], window_size=4, embed_dropout=0.0, attention_dropout=0.0,
        resid_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPTNeoForCausalLM(config)


def _hf_opt(**overrides):
    from transformers import OPTConfig, OPTForCausalLM

    config = dict(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, layerdrop=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return OPTForCausalLM(OPTConfig(**{**config, **overrides}))


def _hf_opt_projected():
    """OPT-350m's shape: post-norm layers, embeddings narrower than the model (replicated project_in/out)."""
    return _hf_opt(word_embed_proj_dim=16, do_layer_norm_before=False)


def _hf_falcon(**overrides):
    from transformers import FalconConfig, FalconForCausalLM

    config = dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=32,
        multi_query=False, new_decoder_architecture=False, alibi=False, bias=True, parallel_attn=True,
        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return FalconForCausalLM(FalconConfig(**{**config, **overrides}))


def _hf_falcon_sequential():
    """Classic Falcon with attention then MLP (post_attention_layernorm) instead of in parallel."""
    return _hf_falcon(parallel_attn=False)


def _hf_falcon_grouped():
    """Falcon's new decoder architecture: 8 query heads in 4 kv groups, laid out [q_g1 q_g2; k_g; v_g] per group."""
    return _hf_falcon(hidden_size=64, num_attention_heads=8, num_kv_heads=4, new_decoder_architecture=True, bias=False)


FAMILIES = {
    "gptj": _hf_gptj,
    "gpt_neo": _hf_gpt_neo,
    "opt": _hf_opt,
    "opt_projected": _hf_opt_projected,
    "falcon": _hf_falcon,
    "falcon_sequential": _hf_falcon_sequential,
    "falcon_grouped_kv": _hf_falcon_grouped,
}


def _all_families_parity(rank, world_size):
    from tp_train.plan.deciding.resolve import find_plan

    results = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        model = build()
        _, source = find_plan(model)
        assert "built-in preset" in source, source  # the preset is what is being tested
        results[name] = parity_errors(model, _hf_logits, VOCAB)
    return results


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    """One spawn per tp runs every family (spawning ranks dominates the cost); each family is its own test."""
    return request.param, run_on_ranks(_all_families_parity, request.param, timeout=300)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_preset_sharded_model_matches_unsharded(parity_results, family):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[family], tp, rank, ATOL)


def _wrong_falcon_split(rank, world_size):
    """The negative control: Falcon's per-head [q_h; k_h; v_h] projection split as if it were [q; k; v]."""
    from tp_train.plan.deciding.families import family, register

    wrong = {**family("falcon").preset, "h.*.self_attention.query_key_value": "fused_qkv_colwise"}
    register(replace(family("falcon"), preset=wrong), replace=True)  # in this rank's process only
    torch.manual_seed(0)
    # verify=False: parity alone must catch the wrong split (verification would refuse it first).
    errors = parity_errors(_hf_falcon(), _hf_logits, VOCAB, steps=1, parallelize_kwargs=dict(verify=False))
    errors.pop("shard_fraction")
    return errors


def test_a_wrong_split_of_falcons_fused_projection_is_caught():
    errors = run_on_ranks(_wrong_falcon_split, 2)[0]
    print(f"wrong falcon split: logits differ by {errors['logits']:.3g}")
    assert errors["logits"] > 1e-3, errors["logits"]  # it runs, but computes something else


def test_falcon_configs_the_preset_cannot_split_are_refused():
    from tp_train.plan.deciding.resolve import find_plan

    with pytest.raises(ValueError, match="ALiBi"):
        find_plan(_hf_falcon(alibi=True))


@pytest.mark.parametrize("model_type", ["bloom", "codegen"])
def test_families_with_unsplittable_layouts_have_no_preset(model_type):
    """Bloom's ALiBi tensor covers all heads (built outside the attention module); CodeGen's qkv_proj is split
    with a hard-coded mp_num=4, which the auto-planner finds (each rank its share of every group's heads, the row
    layer split by the groups): neither gets a preset."""
    from tp_train.plan.deciding.families import family

    assert family(model_type) is None or family(model_type).preset is None
