"""Plan verification: a wrong plan that still runs (a fused [q; k; v] split as one matrix, Falcon's per-head layout
split as [q; k; v], a hidden layer split in halves, a norm over local heads without its gradient sum) or that breaks
the forward (a row layer marked colwise_gather_output) is a one-line `PlanVerificationError` naming where; right
plans pass, for models built on a device or on the meta device, with full or vocab-sharded logits; it is on by
default for every plan, inferred (a model whose attention hard-codes its head count is caught) or given, and
off only when asked; and in a Lightning Trainer, `TensorParallelStrategy(verify_plan=True)` stops a wrong plan
before training while a model with no plan at all is planned, verified and trained."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.test_hf_families import _hf_falcon
from tests.test_parallelize import VOCAB, QKNormModel, SwiGLUModel, _gpt, _hf_gpt2

TINY_GPT = GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)


class HardCodedHeads(nn.Module):
    """Attention that views its heads with a head count kept under a name the `attention` style does not know:
    the structure the auto-planner reads is right, the code on local shapes is not (it runs, with wrong heads)."""

    def __init__(self, vocab=VOCAB, dim=32, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Module()])
        attention = self.layers[0].attention = nn.Module()
        attention.q, attention.k, attention.v, attention.out = (nn.Linear(dim, dim) for _ in range(4))
        self.heads = heads
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        B, T = idx.shape
        x, attention = self.embed(idx), self.layers[0].attention
        q, k, v = (p(x).view(B, T, self.heads, -1).transpose(1, 2) for p in (attention.q, attention.k, attention.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        return self.head(x + attention.out(y))


def _meta_gpt():
    with torch.device("meta"):
        return GPT(TINY_GPT)


def _with(plan: dict[str, str], **changes: str) -> dict[str, str]:
    return {**plan, **changes}


def _gpt2_plan():
    return tp_train.plan.deciding.resolve.resolve_plan(_hf_gpt2())[0]


# name -> (build, plan (None: the model's own), expected fragments of the error, or None when the plan is right)
CASES = {
    "right_gpt": (_gpt, None, None),
    "right_meta_gpt": (_meta_gpt, None, None),
    "right_qk_norm": (QKNormModel, None, None),
    "fused_qkv_split_as_one_matrix": (
        _hf_gpt2,
        lambda: _with(_gpt2_plan(), **{"transformer.h.*.attn.c_attn": "colwise"}),
        ["output differs", "first module whose output differs: 'transformer.h.0.attn.c_proj'",
         "'transformer.h.0.attn.c_attn': 'colwise'"],
    ),
    "falcon_per_head_layout_split_as_qkv": (
        _hf_falcon,
        lambda: _with(tp_train.plan.deciding.resolve.resolve_plan(_hf_falcon())[0],
                      **{"transformer.h.*.self_attention.query_key_value": "fused_qkv_colwise"}),
        ["output differs", "'transformer.h.0.self_attention.query_key_value': 'fused_qkv_colwise'"],
    ),
    "meta_hidden_split_in_halves": (
        _meta_gpt,
        lambda: _with(GPT.tp_plan, **{"blocks.*.mlp.fc": "packed_colwise"}),
        ["output differs", "first module whose output differs: 'blocks.0.mlp.proj'"],
    ),
    "norm_over_local_heads_without_gradient_sum": (
        QKNormModel,
        lambda: SwiGLUModel.tp_plan,
        ["the outputs agree but the gradient of 'layers.0.attn.q_norm.weight' differs",
         "may need 'replicated_with_grad_allreduce'"],
    ),
    "row_layer_marked_colwise_gather_output": (
        _gpt,
        lambda: _with(GPT.tp_plan, **{"blocks.*.mlp.proj": "colwise_gather_output"}),
        ["the sharded model fails on a probe batch in the forward of 'blocks.0.mlp.proj' (RuntimeError:"],
    ),
}  # fmt: skip


def _verify_cases(rank, world_size):
    results = {}
    for name, (build, plan, _) in CASES.items():
        torch.manual_seed(0)
        try:
            model = tp_train.parallelize(build(), plan=plan() if plan else None, verify=True)
            results[name] = model.training  # left in its mode
        except tp_train.PlanVerificationError as error:
            results[name] = str(error)
    torch.manual_seed(0)
    model = tp_train.parallelize(_gpt(), loss_parallel=True, verify=True)  # vocab-sharded logits, gathered to check
    results["right_loss_parallel"] = model.training
    torch.manual_seed(0)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            tp_train.parallelize(HardCodedHeads())  # an inferred plan: verified by default
        results["inferred_plan_verified_by_default"] = "no error"
    except tp_train.PlanVerificationError as error:
        results["inferred_plan_verified_by_default"] = str(error)
    # On by default for a given plan too; verify=False lets the wrong split through silently (test_plan shows it
    # computes another function).
    wrong = _with(_gpt2_plan(), **{"transformer.h.*.attn.c_attn": "colwise"})
    torch.manual_seed(0)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            tp_train.parallelize(_hf_gpt2(), plan=wrong)
        results["given_plan_verified_by_default"] = "no error"
    except tp_train.PlanVerificationError as error:
        results["given_plan_verified_by_default"] = str(error)
    torch.manual_seed(0)
    results["silent_without_verify"] = tp_train.parallelize(_hf_gpt2(), plan=wrong, verify=False).training
    return results


@pytest.fixture(scope="module")
def verified():
    return run_on_ranks(_verify_cases, 2, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_verification_catches_wrong_plans_and_passes_right_ones(verified, name):
    expected = CASES[name][2]
    for result in verified:
        if expected is None:
            assert result[name] is True, result[name]  # no error, and the model back in training mode
        else:
            assert isinstance(result[name], str) and "\n" not in result[name]
            assert result[name].startswith("tensor-parallel plan verification failed (rank 0): "), result[name]
            for fragment in expected:
                assert fragment in result[name], result[name]


@pytest.mark.slow
def test_verification_is_on_by_default_for_every_plan_and_gathers_vocab_sharded_logits(verified):
    for result in verified:
        assert result["right_loss_parallel"] is True
        assert result["silent_without_verify"] is True
        assert "'transformer.h.0.attn.c_attn': 'colwise'" in result["given_plan_verified_by_default"]
        message = result["inferred_plan_verified_by_default"]
        assert "output differs" in message and "first module whose output differs: 'layers.0.attention.out'" in message


def _train_with_strategy(rank, world_size, case):
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.lightning_helpers import token_data
    from tp_train import CausalLMModule, TensorParallelStrategy

    torch.manual_seed(0)
    model = QKNormModel()
    # The wrong plan leaves out the gradient sum of the norm over local heads; with no plan anywhere, the
    # auto-planner plans the LightningModule.
    model.tp_plan = SwiGLUModel.tp_plan if case == "wrong_plan" else None
    module = CausalLMModule(model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    trainer = L.Trainer(
        strategy=TensorParallelStrategy(tensor_parallel_size=world_size, verify_plan=True if case else None),
        accelerator="cpu", devices=world_size, max_steps=2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            trainer.fit(module, DataLoader(token_data(2).tensors[0], batch_size=4))
    except tp_train.PlanVerificationError as error:
        return str(error)
    return printed.getvalue(), trainer.global_step


@pytest.mark.slow
def test_the_strategy_verifies_before_training():
    refused = run_on_ranks(_train_with_strategy, 2, "wrong_plan", timeout=300)
    for message in refused:
        assert "gradient of 'layers.0.attn.q_norm.weight' differs" in message, message
    for printed, steps in run_on_ranks(_train_with_strategy, 2, "", timeout=300)[:1]:
        assert "tensor-parallel plan (inferred by the auto-planner):" in printed
        assert "model.layers.*.attn.q_norm  replicated_with_grad_allreduce" in printed
        assert steps == 2
