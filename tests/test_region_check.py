"""Per-module verification of plan entries that swap no module (`tp_train.plan.checking.region_check`): a wrong split of
parameters sharded in place, or a missing collective around a region, is refused even where the whole-model check
is skipped (a model above `WHOLE_MODEL_CHECK_BYTES`, here lowered to 0 in each rank)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
import torch.nn as nn

import tp_train
import tp_train.plan.parallelize as parallelize_module
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_hf_plan_vocabulary import _build, _logits
from tests.test_parallelize import VOCAB
from tp_train.errors import PlanVerificationError
from tp_train.plan.deciding.resolve import resolve_plan

MIXTRAL = ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2))
GATE_UP = "model.layers.*.mlp.experts.gate_up_proj"


def _refusal(parallelize) -> str | None:
    """The one-line refusal of `parallelize()` with the whole-model check skipped, or None when it passes."""
    parallelize_module.WHOLE_MODEL_CHECK_BYTES = 0
    try:
        parallelize()
    except PlanVerificationError as error:
        return str(error)
    return None


def _fused_experts(rank, world_size, style):
    torch.manual_seed(0)
    model = _build(*MIXTRAL)
    plan = {**resolve_plan(model)[0], GATE_UP: style}
    refusal = _refusal(lambda: tp_train.parallelize(model, plan=plan))
    if refusal is not None or style != "packed_colwise":
        return refusal
    parallelize_module.WHOLE_MODEL_CHECK_BYTES = 0
    torch.manual_seed(0)
    return parity_errors(_build(*MIXTRAL), _logits, VOCAB, parallelize_kwargs=dict(plan=plan))


@pytest.mark.parametrize("tp", [2, 4])
def test_fused_gate_up_experts_split_as_one_block_are_refused_without_the_whole_model_check(tp):
    for refusal in run_on_ranks(_fused_experts, tp, "colwise", timeout=300):
        assert refusal is not None, "a [gate; up] expert weight split colwise passed verification"
        assert "'model.layers.0.mlp.experts'" in refusal and "gate_up_proj': 'colwise'" in refusal, refusal
        assert "differs from the unsharded module by" in refusal and "\n" not in refusal, refusal


def test_fused_gate_up_experts_split_half_by_half_pass_with_parity():
    for rank, errors in enumerate(run_on_ranks(_fused_experts, 2, "packed_colwise", timeout=300)):
        assert not isinstance(errors, str), errors
        assert_parity(errors, 2, rank, block_rel_tol=0.02)  # the router stays whole


class _Inner(nn.Module):
    """An MLP computing on its own 2-D weights (no Linear a column layer would replace)."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(hidden, width))
        self.w_out = nn.Parameter(torch.empty(width, hidden))
        if not self.w_in.is_meta:
            self.reset_parameters()

    def reset_parameters(self):  # a model built on the meta device is initialised by it, per module
        with torch.no_grad():
            self.w_in.copy_(torch.randn(self.w_in.shape) / self.w_in.shape[1] ** 0.5)
            self.w_out.copy_(torch.randn(self.w_out.shape) / self.w_out.shape[1] ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.w_in.t()) @ self.w_out.t()


class _Wrapper(nn.Module):
    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.inner = _Inner(width, hidden)

    def forward(self, x):
        return self.inner(x)


class _TinyLM(nn.Module):
    def __init__(self, width: int = 16, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList([_Wrapper(width, hidden)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        return self.head(x + self.layers[0](x))


SPLIT = {"layers.0.inner.w_in": "colwise", "layers.0.inner.w_out": "rowwise"}
# The all-reduce wraps the module whose own weights are split: its input enters the parallel region too.
RIGHT = {"layers.0.inner": "all_reduce", **SPLIT}
# The all-reduce wraps the parent: its output is summed, but nothing sums the partial gradients of the input.
MISSING_ENTRY = {"layers.0": "all_reduce", "layers.0.inner": "local_params", **SPLIT}


def _region(rank, world_size, plan):
    torch.manual_seed(0)
    refusal = _refusal(lambda: tp_train.parallelize(_TinyLM(), plan=plan))
    if refusal is not None or plan != RIGHT:
        return refusal
    parallelize_module.WHOLE_MODEL_CHECK_BYTES = 0
    torch.manual_seed(0)
    return parity_errors(_TinyLM(), lambda model, idx: model(idx), VOCAB, parallelize_kwargs=dict(plan=plan))


def test_an_all_reduce_region_whose_input_gradient_is_a_partial_sum_is_refused():
    for refusal in run_on_ranks(_region, 2, MISSING_ENTRY, timeout=300):
        assert refusal is not None, "a region with partial input gradients passed verification"
        assert "module 'layers.0' (_Wrapper) planned 'all_reduce'" in refusal, refusal
        assert "in its gradient of argument 0" in refusal, refusal


def test_an_all_reduce_region_entering_the_parallel_region_passes_with_parity():
    for rank, errors in enumerate(run_on_ranks(_region, 2, RIGHT, timeout=300)):
        assert not isinstance(errors, str), errors
        assert_parity(errors, 2, rank)


def _on_meta(rank, world_size):
    with torch.device("meta"):
        model = _TinyLM()
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        tp_train.parallelize(model, plan=RIGHT, device="cpu", verify=None)
    return output.getvalue()


def test_a_model_on_the_meta_device_skips_the_region_check_and_says_so():
    """Nothing to compute before sharding there (its weights are made module by module while it is sharded)."""
    printed = run_on_ranks(_on_meta, 2, timeout=300)[0]
    assert "region modules not checked (the model is on the meta device)" in printed, printed
