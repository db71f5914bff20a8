"""Reading plans: where a plan comes from, how patterns match, and the clear ValueError for a plan that does not
apply (raised before any weight changes). Also the negative control: a naive split of GPT-2's fused c_attn
'trains' but is a different function, and the parity check catches it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.parity import parity_errors
from tests.test_parallelize import VOCAB, _hf_gpt2, _hf_llama, _hf_logits
from tp_train.plan.deciding.families import family
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.styles import pattern_matches


def _gpt(**overrides):
    config = dict(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)
    return GPT(GPTConfig(**{**config, **overrides}))


def _hf_llama_kv(kv_heads: int, heads: int = 8, hidden: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=96, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=kv_heads, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config)


class _NoPlan(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 10), nn.Linear(10, 8)


def test_pattern_star_matches_exactly_one_component():
    assert pattern_matches("blocks.*.attn.q", "blocks.0.attn.q")
    assert pattern_matches("blocks.*.attn.q", "blocks.11.attn.q")
    assert not pattern_matches("blocks.*.attn.q", "blocks.0.attn.q.extra")
    assert not pattern_matches("blocks.*.q", "blocks.0.attn.q")
    assert not pattern_matches("blocks.*.attn.q", "blocks.0.attn.qq")


def test_plan_sources_in_order():
    explicit = {"blocks.*.mlp.fc": "colwise"}
    assert resolve_plan(_gpt(), explicit)[0] == explicit
    assert resolve_plan(_gpt())[0] == GPT.tp_plan
    llama_plan, source = resolve_plan(_hf_llama())
    assert "base_model_tp_plan" in source and llama_plan["model.layers.*.self_attn.q_proj"] == "colwise"
    gpt2_plan, source = resolve_plan(_hf_gpt2())
    assert "preset" in source
    assert gpt2_plan["transformer.h.*.attn.c_attn"] == family("gpt2").preset["h.*.attn.c_attn"] == "fused_qkv_colwise"
    assert gpt2_plan["lm_head"] == "colwise_gather_output"
    with pytest.raises(ValueError, match="no tensor-parallel plan for _NoPlan"):
        resolve_plan(_NoPlan())


BAD_PLANS = {
    "matches_nothing": (_gpt, {"blocks.*.attn.query": "colwise"}, "'blocks.*.attn.query' matches no module"),
    "indivisible_out_features": (
        _NoPlan,
        {"up": "colwise", "down": "rowwise"},
        "module 'up' (Linear): out_features=10 is not divisible by tensor_parallel_size=4",
    ),
    "indivisible_heads": (lambda: _gpt(n_head=2), None, "config.n_head=2 is not divisible by tensor_parallel_size=4"),
    "kv_heads_neither_divide_nor_replicate": (
        lambda: _hf_llama_kv(3, heads=12, hidden=96),
        None,
        "config.num_key_value_heads=3 neither divides nor is divisible by tensor_parallel_size=4: each rank must "
        "hold whole kv heads, or replicas of one; use a tensor_parallel_size in [1, 3] or a multiple of 3",
    ),
    "indivisible_fused_sections": (
        _NoPlan,
        {"up": "fused_qkv_colwise"},
        "module 'up' (Linear): out_features=10 does not split into 3 sections",
    ),
    "unknown_style": (_gpt, {"blocks.*.mlp.fc": "columnwise"}, "unknown style 'columnwise'; known styles:"),
    "wrong_module_type": (
        _gpt,
        {"blocks.*.ln_1": "colwise"},
        "'blocks.0.ln_1' (LayerNorm) cannot take style 'colwise'",
    ),
}


def _bad_plans(rank, world_size):
    results = {}
    for name, (build, plan, _) in BAD_PLANS.items():
        torch.manual_seed(0)
        model = build()
        before = copy.deepcopy(model.state_dict())
        modules_before = [type(m) for m in model.modules()]
        try:
            tp_train.parallelize(model, plan=plan)
            message = None
        except ValueError as error:
            message = str(error)
        after = model.state_dict()
        unchanged = modules_before == [type(m) for m in model.modules()] and all(
            torch.equal(before[key], after[key]) for key in before
        )
        results[name] = (message, unchanged)
    return results


def test_bad_plans_raise_one_line_value_error_before_any_change():
    results = run_on_ranks(_bad_plans, 4, timeout=180)[0]
    for name, (_, _, expected) in BAD_PLANS.items():
        message, unchanged = results[name]
        assert message is not None, f"{name}: no ValueError"
        assert expected in message, f"{name}: {message}"
        assert "\n" not in message
        assert unchanged, f"{name}: the model changed before the error"


def _naive_fused_qkv_split(rank, world_size):
    torch.manual_seed(0)
    plan = {**tp_train.plan.deciding.resolve.resolve_plan(_hf_gpt2())[0], "transformer.h.*.attn.c_attn": "colwise"}

    class Naive(nn.Module):  # the same GPT-2, with a plan that splits [q; k; v] as if it were one matrix
        def __init__(self):
            super().__init__()
            self.inner = _hf_gpt2()

        def forward(self, input_ids):
            return self.inner(input_ids=input_ids)

    naive = Naive()
    naive.tp_plan = {f"inner.{pattern}": style for pattern, style in plan.items()}
    # verify=False: this shows that parity alone catches the wrong split (verification would refuse it first).
    return parity_errors(naive, _hf_logits, VOCAB, steps=1, parallelize_kwargs=dict(verify=False))["logits"]


def test_naive_split_of_fused_qkv_is_caught_by_parity():
    logits_error = run_on_ranks(_naive_fused_qkv_split, 2, timeout=180)[0]
    assert logits_error > 1e-3
