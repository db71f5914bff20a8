"""Adapters under tensor parallelism (`tp_train.plan.applying.adapters`): a Llama wrapped by `peft.get_peft_model`
(LoRA on q_proj, v_proj and down_proj) shards with no plan given, through the wrapper, and computes the unsharded
model's function with only the adapters training: lora_B split with a column base's output, lora_A with a row base's
input, and the row layer's adapter summed by its one all-reduce."""

from __future__ import annotations

import contextlib
import copy
import io

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors

VOCAB = 101
TARGETS = ["q_proj", "v_proj", "down_proj"]


def llama():
    """A tiny Llama: 4 heads, 2 kv heads (replicated at tp 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def lora_llama(**lora):
    """`llama()` with LoRA adapters whose B is random (peft starts it at zero, which would hide a wrong gradient of A
    at the first step)."""
    from peft import LoraConfig, get_peft_model

    options = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0) | lora
    model = get_peft_model(llama(), LoraConfig(**options))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)
    return model


def _logits(model, idx):
    return model(input_ids=idx).logits


def _parity(rank, world_size):
    torch.manual_seed(0)
    reference = lora_llama()
    trainable = sorted(name for name, param in reference.named_parameters() if param.requires_grad)
    with contextlib.redirect_stdout(io.StringIO()):
        errors = parity_errors(reference, _logits, VOCAB)
        sharded = tp_train.parallelize(copy.deepcopy(reference))
    specs = {name: (spec.dim, spec.sections) for name, _, spec in tp_train.named_sharded_parameters(sharded)}
    still_trainable = sorted(name for name, param in sharded.named_parameters() if param.requires_grad)
    return errors, trainable, still_trainable, specs


@pytest.fixture(scope="module", params=[2, 4])
def parity(request):
    return request.param, run_on_ranks(_parity, request.param, timeout=600)


@pytest.mark.slow
def test_a_lora_wrapped_llama_shards_with_no_plan_and_matches_unsharded(parity):
    tp, results = parity
    for rank, (errors, trainable, still_trainable, _) in enumerate(results):
        grads = {key for key in errors if key.startswith("grad:")}
        assert grads and all("lora_" in key for key in grads), grads  # only the adapters train
        # Replicated: lora_A beside column layers, lora_B beside row ones, and kv heads fewer than ranks at tp 4.
        assert_parity(errors, tp, rank, block_rel_tol=0.05 if tp == 2 else 0.25)
        assert still_trainable == trainable and all("lora_" in name for name in trainable)


@pytest.mark.slow
def test_adapters_split_with_their_base_layers(parity):
    _, results = parity
    specs = results[0][3]
    layer = "base_model.model.model.layers.0"
    assert specs[f"{layer}.self_attn.q_proj.base_layer.weight"] == (0, (64,))
    assert specs[f"{layer}.self_attn.q_proj.lora_B.default.weight"] == (0, (64,))  # with the output rows
    assert f"{layer}.self_attn.q_proj.lora_A.default.weight" not in specs  # whole on every rank
    assert specs[f"{layer}.mlp.down_proj.base_layer.weight"] == (1, (96,))
    assert specs[f"{layer}.mlp.down_proj.lora_A.default.weight"] == (1, (96,))  # with the input features
    assert f"{layer}.mlp.down_proj.lora_B.default.weight" not in specs


def _forward_collectives(rank, world_size):
    counts = {}
    for name, build in (("plain", llama), ("lora", lora_llama)):
        torch.manual_seed(0)
        with contextlib.redirect_stdout(io.StringIO()):
            model = tp_train.parallelize(build(), verify=False)
        (counter,) = tp_train.plan.parallelize.attached(model, "tp_comm_counter")
        counter.reset()
        with torch.no_grad():
            model(input_ids=torch.randint(0, VOCAB, (1, 8)))
        counts[name] = (counter.calls, counter.bytes)
    return counts


@pytest.mark.slow
def test_a_row_layers_adapter_adds_no_collective_to_the_forward():
    """Its partial sum joins the base layer's before the one all-reduce."""
    counts = run_on_ranks(_forward_collectives, 2, timeout=300)[0]
    assert counts["lora"] == counts["plain"], counts


def _refusals(rank, world_size):
    messages = {}
    for case, options, kwargs in (
        ("dora", dict(use_dora=True), {}),
        ("sequence_parallel", {}, dict(sequence_parallel=True)),
    ):
        torch.manual_seed(0)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                tp_train.parallelize(lora_llama(**options), verify=False, **kwargs)
        except ValueError as error:
            messages[case] = str(error)
    return messages


@pytest.mark.slow
def test_what_adapters_cannot_do_yet_is_refused_in_one_line():
    messages = run_on_ranks(_refusals, 2, timeout=300)[0]
    assert messages["dora"] == (
        "module 'model.layers.0.self_attn.q_proj' (Linear): a LoRA variant (DoRA and others; plain LoRA is) is not "
        "supported under tensor parallelism"
    ), messages
    assert messages["sequence_parallel"].startswith(
        "sequence_parallel does not support adapters yet: 'model.layers.0.self_attn.q_proj' is a Linear"
    ), messages
    assert all("\n" not in message for message in messages.values())
