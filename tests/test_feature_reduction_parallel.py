"""`feature_reduction_parallel`: a module between a column and a row layer that reduces over the features they split
(ConvNeXt V2's Global Response Normalisation, a mean over the channels) keeps its parameters' share along their last
dim and has each mean, sum or L2 normalize over the features completed by an all-reduce. Checked at tp 2 and 4 in a
tiny LM whose MLPs hold a GRN (a mean over the features) and an L2 normalisation (a sum of squares over them), planned
by hand and by the auto-planner; a reduction the region does not complete (`torch.linalg.vector_norm` over the
features) is refused by verification, and one over the features together with other dims names itself. ConvNeXt V2
itself: `python -m tp_train.tools.zoo --task image-classification --families convnextv2`."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity
from tests.test_layernorm_parallel import parity_and_refusal
from tests.test_parallelize import ATOL
from tests.test_rmsnorm_parallel import NormedMLPLM
from tp_train.parallel.reductions import FeatureReductionRegion

PLAN = {
    "layers.*.up": "colwise",
    "layers.*.grn": "feature_reduction_parallel",
    "layers.*.scale": "feature_reduction_parallel",
    "layers.*.down": "rowwise",
}


class GlobalResponseNorm(nn.Module):
    """ConvNeXt V2's GRN on (batch, tokens, features): each feature's L2 norm over the tokens, divided by its mean
    over the features."""

    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(0.5 * torch.randn(1, 1, width))
        self.bias = nn.Parameter(0.1 * torch.randn(1, 1, width))

    def forward(self, x):
        norms = torch.linalg.vector_norm(x, ord=2, dim=1, keepdim=True)
        return self.weight * (x * norms / (norms.mean(dim=-1, keepdim=True) + 1e-6)) + self.bias + x


class L2Scale(nn.Module):
    """Each token's features L2-normalised over all of them (SwiftFormer's query), scaled per feature, and shifted
    by their sum."""

    def __init__(self, width: int):
        super().__init__()
        self.gain = nn.Parameter(1 + 0.1 * torch.randn(1, width))

    def forward(self, x):
        return self.gain * F.normalize(x, dim=-1) + 0.01 * torch.sum(x, -1, keepdim=True)


class VectorNormGRN(GlobalResponseNorm):
    """A mean over the features the region completes, then a norm over them it does not."""

    def forward(self, x):
        return super().forward(x) / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int, grn: type):
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.grn = grn(hidden)
        self.scale = L2Scale(hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(self.scale(self.grn(torch.relu(self.up(x)))))


class ReducingLM(NormedMLPLM):
    """Embedding, two blocks of up -> GRN -> L2 scale -> down, a head."""

    def __init__(self, grn: type = GlobalResponseNorm, width: int = 16, hidden: int = 32):
        super().__init__("float_statistics", width=width, hidden=hidden)
        self.layers = nn.ModuleList(_Block(width, hidden, grn) for _ in range(2))
        self.tp_plan = PLAN


def _on_ranks(rank, world_size):
    parity, refusal = parity_and_refusal(ReducingLM, lambda: ReducingLM(VectorNormGRN))
    whole = nn.Module()
    whole.forward = lambda x: x.mean()
    FeatureReductionRegion(dist.group.WORLD).install(whole)
    try:
        whole(torch.ones(2, 4))
    except TypeError as error:
        return parity, refusal, str(error)
    return parity, refusal, None


@functools.cache
def _results(tp: int) -> list:
    return run_on_ranks(_on_ranks, tp, timeout=300)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("planned", ["by_hand", "auto"])
def test_reductions_over_split_features_match_unsharded(planned, tp):
    """Logits, gradients and three steps of losses within 1e-5; each rank holds 1/tp of every sharded parameter (the
    GRN's and the scale's along their last dim included) and of the block matrices."""
    for rank, (parity, _, _) in enumerate(_results(tp)):
        assert_parity(parity[planned], tp, rank, ATOL)


def test_verification_refuses_a_reduction_the_region_does_not_complete():
    for _, refusal, _ in _results(2):
        assert refusal is not None, "a vector_norm over split features, planned 'feature_reduction_parallel', passed"
        assert "(VectorNormGRN) planned 'feature_reduction_parallel'" in refusal
        assert "\n" not in refusal


def test_a_reduction_over_the_features_and_other_dims_is_refused_in_one_line():
    for _, _, mixed in _results(2):
        assert mixed is not None and "'mean' over dims None of a (2, 4) tensor" in mixed and "\n" not in mixed


def test_the_auto_planner_puts_a_module_reducing_over_split_features_in_the_new_style():
    """Its reductions held in the planner's perturbed probes, the module spreads no share to the others; ConvNeXt V2's
    GRN between pwconv1 and pwconv2 is planned the same way."""
    from tp_train.tools.zoo import build_family

    model = ReducingLM()
    del model.tp_plan
    plan = tp_train.infer_plan(model, tensor_parallel_size=2)
    assert {key: plan[key] for key in PLAN} == PLAN
    torch.manual_seed(0)
    convnext = tp_train.infer_plan(build_family("image-classification", "convnextv2"), tensor_parallel_size=2)
    layers = "convnextv2.encoder.stages.*.layers.*"
    expected = {"pwconv1": "colwise", "grn": "feature_reduction_parallel", "pwconv2": "rowwise"}
    assert {key: convnext[f"{layers}.{key}"] for key in expected} == expected
