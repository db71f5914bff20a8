"""What context parallelism cannot split exactly is refused in one line naming the module and the reason, before any
rank starts (`check_context_parallel`, which preflight calls on the model built on the meta device)."""

from __future__ import annotations

import re

import pytest
import torch

from models import GPT, GPTConfig, hugging_face_causal_lm
from tp_train.parallel.context_parallel.models import check_context_parallel

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip


def _hf(kind, **fields):
    with torch.device("meta"):
        return hugging_face_causal_lm(kind, config={**SMALL, **fields})


@pytest.mark.parametrize(
    ("kind", "fields", "message"),
    [
        ("gemma2", {"attn_logit_softcapping": 50.0}, "gemma2 (Gemma2ForCausalLM): config.attn_logit_softcapping"),
        ("mistral", {"sliding_window": 16}, "mistral: config.sliding_window=16 < sequence length 32"),
        ("llama", {"attention_dropout": 0.1}, "llama: config.attention_dropout=0.1"),
    ],
)
def test_refused_in_one_line_naming_the_model_and_reason(kind, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        check_context_parallel(_hf(kind, **fields), sequence_length=32)
    assert "\n" not in str(error.value)


def test_accepted_where_exact():
    for kind, fields in (("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 64}), ("gemma", {})):
        check_context_parallel(_hf(kind, **fields), sequence_length=32)  # a window >= the sequence changes nothing
    check_context_parallel(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.0)))


def test_our_gpt_with_attention_dropout_is_refused():
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=8, dropout=0.1))
    with pytest.raises(ValueError, match=r"blocks.0.attn: attention dropout 0.1 cannot be context-parallel"):
        check_context_parallel(model)


def test_alltoall_with_query_heads_per_rank_not_dividing_by_cp_is_refused_before_any_rank():
    """The all-to-all gives each context-parallel rank 1/cp of the heads a tensor-parallel rank holds: 4 heads at tp=2
    leave 2, which cp=4 cannot split; ring and all-gather split tokens, not heads, and take them."""
    model = _hf("llama")
    with pytest.raises(ValueError) as error:
        check_context_parallel(model, 32, rotation="alltoall", cp=4, tp=2)
    assert str(error.value) == (
        "config.num_attention_heads=4 at tp=2: 2 query heads per rank (after tensor parallelism) do not divide by "
        "cp=4, as context_parallel_rotation='alltoall' needs; use cp in [2] or rotation 'ring' or 'allgather'"
    )
    check_context_parallel(model, 32, rotation="alltoall", cp=2, tp=2)
    check_context_parallel(model, 32, rotation="ring", cp=4, tp=2)
