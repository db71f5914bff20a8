"""`rmsnorm_parallel`: an RMS norm between a column and a row layer, over features split across ranks, has its weight
split with them and normalises over the whole width (the sum of squares all-reduced forward and backward). Checked on
hand-written norms (Hugging Face's float32 form, torch's `nn.RMSNorm` with its default epsilon, Gemma's `1 + w`) in
a tiny LM at tp 2, planned by hand and by the auto-planner; a norm the correction does not fit (one that centres its
input) is refused by verification, and a module with no epsilon by the plan reader. BitNet's parity is in
`tests/test_planner_families.py`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import VOCAB_OF_TESTS, assert_parity, parity_of_each
from tests.test_parallelize import ATOL
from tests.test_planner_families import _logits
from tp_train.errors import PlanVerificationError
from tp_train.parallel.collectives import sum_across_tensor_parallel_region
from tp_train.plan.deciding.match import match_plan

PLAN = {"layers.*.up": "colwise", "layers.*.norm": "rmsnorm_parallel", "layers.*.down": "rowwise"}


class HandWrittenRMSNorm(nn.Module):
    """Hugging Face's form: statistics in float32, the epsilon as `variance_epsilon`."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.variance_epsilon = eps

    def forward(self, x):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.variance_epsilon)).to(x.dtype)


class OffsetRMSNorm(nn.Module):
    """Gemma's form: scaled by `1 + weight`; a large epsilon, so that where it is added matters."""

    def __init__(self, width: int, eps: float = 0.3):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class CenteredNorm(nn.Module):
    """Not an RMS norm: it subtracts the mean first, which no correction of the mean of squares can fix."""

    def __init__(self, width: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.eps = eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class NoEpsilonNorm(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


NORMS = {
    "float_statistics": HandWrittenRMSNorm,
    "torch_rmsnorm_default_eps": nn.RMSNorm,
    "offset_large_eps": OffsetRMSNorm,
    "centered": CenteredNorm,
    "no_epsilon": NoEpsilonNorm,
}


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int, norm: str):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.norm = NORMS[norm](hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.norm(torch.relu(self.up(x))))


class NormedMLPLM(nn.Module):
    """Embedding, two blocks of up -> norm over the hidden features -> down, and a head."""

    def __init__(self, norm: str, vocab: int = VOCAB_OF_TESTS, width: int = 16, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_Block(width, hidden, norm) for _ in range(2))
        self.head = nn.Linear(width, vocab)
        self.tp_plan = PLAN

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _build(norm: str):
    return lambda: NormedMLPLM(norm)


def _auto_planned():
    model = NormedMLPLM("float_statistics")
    del model.tp_plan
    return model


MATCHING = ("float_statistics", "torch_rmsnorm_default_eps", "offset_large_eps")


def _on_ranks(rank, world_size):
    x = torch.tensor([float(rank + 1)], requires_grad=True)
    total = sum_across_tensor_parallel_region(x, dist.group.WORLD)
    (total * 10 * (rank + 1)).sum().backward()  # each rank uses the total with its own weight
    collective = (total.item(), x.grad.item())
    parity = parity_of_each({name: (_build(name), _logits) for name in MATCHING} | {"auto": (_auto_planned, _logits)})
    torch.manual_seed(0)
    try:
        tp_train.parallelize(NormedMLPLM("centered"))
        refusal = None
    except PlanVerificationError as error:
        refusal = str(error)
    return collective, parity, refusal


_RESULTS: list = []


def _results() -> list:
    if not _RESULTS:
        _RESULTS.extend(run_on_ranks(_on_ranks, 2, timeout=300))
    return _RESULTS


def test_the_sum_across_ranks_is_all_reduced_forward_and_backward():
    """Each rank's partial value feeds every rank's total: its gradient sums what every rank's use of it gives."""
    for rank, (collective, _, _) in enumerate(_results()):
        assert collective == (3.0, 30.0), f"rank {rank}: total and gradient {collective}"


@pytest.mark.parametrize("norm", [*MATCHING, "auto"])
def test_a_norm_over_split_features_matches_unsharded(norm):
    """Logits, gradients and three steps of losses within 1e-5; each rank holds half of every sharded parameter
    (the norm's weight included) and of the block matrices."""
    for rank, (_, parity, _) in enumerate(_results()):
        assert_parity(parity[norm], 2, rank, ATOL)


def test_verification_refuses_a_norm_the_correction_does_not_fit():
    for _, _, refusal in _results():
        assert refusal is not None, "a centring norm planned 'rmsnorm_parallel' was accepted"
        assert "module 'layers.0.norm' (CenteredNorm) planned 'rmsnorm_parallel'" in refusal
        assert "\n" not in refusal


def test_a_norm_with_no_epsilon_attribute_is_refused_in_one_line():
    with pytest.raises(ValueError) as refusal:
        match_plan(NormedMLPLM("no_epsilon"), PLAN, 2)
    message = str(refusal.value)
    assert "module 'layers.0.norm' (NoEpsilonNorm) cannot take style 'rmsnorm_parallel'" in message
    assert "variance_epsilon" in message and "\n" not in message


def test_the_auto_planner_puts_an_rms_norm_between_column_and_row_in_the_new_style():
    """Its statistic held in the planner's perturbed probes, the norm spreads no share to the others; BitNet, given no
    plan, is planned as its preset plans it."""
    from tests.test_planner_families import _family
    from tp_train.plan.deciding.families import family

    plan = tp_train.infer_plan(_auto_planned(), tensor_parallel_size=2)
    assert {key: plan[key] for key in PLAN} == PLAN
    bitnet = tp_train.infer_plan(_family("bitnet"), tensor_parallel_size=2)
    preset = {f"model.{key}": style for key, style in family("bitnet").preset.items()}
    assert dict(bitnet) == preset | {"lm_head": "colwise_gather_output"}
