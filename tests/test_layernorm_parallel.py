"""`layernorm_parallel`: a LayerNorm over features split across ranks (ESM C's q_norm and k_norm, over every head's
features of q and k) has its weight and bias split with them and normalises with the mean and variance over the
whole width (one all-reduce). Checked at tp 2 and 4 in a tiny LM of an MLP block (a LayerNorm between up and down)
and an ESM C-like attention (LayerNorms over q's and k's whole width before the heads), planned by hand and by the
auto-planner; a module the recomputation does not fit (a LayerNorm subclass that does not centre) is refused by
verification, and a module that is no LayerNorm by the plan reader. ESM C itself: `python -m tp_train.tools.zoo
--task masked-lm --families esmc`."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_of_each
from tests.test_parallelize import ATOL
from tests.test_planner_families import _logits
from tests.test_rmsnorm_parallel import NormedMLPLM
from tp_train.errors import PlanVerificationError
from tp_train.plan.deciding.match import match_plan

PLAN = {
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.q_norm": "layernorm_parallel",
    "layers.*.attn.k_norm": "layernorm_parallel",
    "layers.*.attn.o": "rowwise",
    "layers.*.up": "colwise",
    "layers.*.norm": "layernorm_parallel",
    "layers.*.down": "rowwise",
}


class UncenteredLayerNorm(nn.LayerNorm):
    """An nn.LayerNorm whose forward does not centre (an RMS norm in its clothes): the recomputation does not fit."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) + self.bias


class _Attention(nn.Module):
    """ESM C's shape: LayerNorms over q's and k's whole width, then heads viewed with -1 (no head count kept)."""

    def __init__(self, width: int, head_dim: int, norm: type):
        super().__init__()
        self.head_dim = head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))
        self.q_norm, self.k_norm = norm(width), norm(width)

    def forward(self, x):
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_norm(self.q(x)).view(shape).transpose(1, 2)
        k = self.k_norm(self.k(x)).view(shape).transpose(1, 2)
        v = self.v(x).view(shape).transpose(1, 2)
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(-2))


class _Block(nn.Module):
    def __init__(self, width: int, hidden: int, norm: type):
        super().__init__()
        self.attn = _Attention(width, 4, norm)
        self.up = nn.Linear(width, hidden)
        self.norm = norm(hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.norm(self.up(x))))


class LayerNormedLM(NormedMLPLM):
    """Embedding, two blocks (attention with QK-LayerNorms over the whole width, then an MLP with a LayerNorm over its
    hidden features), a head. The norms' weights and biases are random, and the up layer's bias shifts each feature
    by up to 3, so that the ranks' shares have different means (what the pooled variance must combine)."""

    def __init__(self, norm: type = nn.LayerNorm, width: int = 16, hidden: int = 32):
        super().__init__("float_statistics", width=width, hidden=hidden)
        self.layers = nn.ModuleList(_Block(width, hidden, norm) for _ in range(2))
        for module in self.modules():
            if isinstance(module, nn.LayerNorm):
                nn.init.normal_(module.weight, 1.0, 0.1)
                nn.init.normal_(module.bias, 0.0, 0.1)
        for layer in self.layers:
            nn.init.uniform_(layer.up.bias, -3.0, 3.0)
        self.tp_plan = PLAN


def parity_and_refusal(build, refused) -> tuple[dict, str | None]:
    """In a rank: the parity of `build()`'s model planned by its `tp_plan` ("by_hand") and by the auto-planner
    ("auto"), and the one-line verification refusal of `refused()`'s (None if it was accepted)."""

    def auto_planned():
        model = build()
        del model.tp_plan
        return model

    parity = parity_of_each({"by_hand": (build, _logits), "auto": (auto_planned, _logits)})
    torch.manual_seed(0)
    try:
        tp_train.parallelize(refused())
    except PlanVerificationError as error:
        return parity, str(error)
    return parity, None


def _on_ranks(rank, world_size):
    return parity_and_refusal(LayerNormedLM, lambda: LayerNormedLM(UncenteredLayerNorm))


@functools.cache
def _results(tp: int) -> list:
    return run_on_ranks(_on_ranks, tp, timeout=300)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("planned", ["by_hand", "auto"])
def test_a_layernorm_over_split_features_matches_unsharded(planned, tp):
    """Logits, gradients and three steps of losses within 1e-5; each rank holds 1/tp of every sharded parameter (the
    norms' weights and biases included) and of the block matrices."""
    for rank, (parity, _) in enumerate(_results(tp)):
        assert_parity(parity[planned], tp, rank, ATOL)


def test_verification_refuses_a_layernorm_that_does_not_centre():
    for _, refusal in _results(2):
        assert refusal is not None, "a LayerNorm subclass that does not centre, planned 'layernorm_parallel', passed"
        assert "(UncenteredLayerNorm) planned 'layernorm_parallel'" in refusal
        assert "\n" not in refusal


def test_a_module_that_is_no_layernorm_is_refused_in_one_line():
    model = LayerNormedLM()
    model.layers[0].norm = nn.RMSNorm(32)
    with pytest.raises(ValueError) as refusal:
        match_plan(model, PLAN, 2)
    message = str(refusal.value)
    assert "module 'layers.0.norm' (RMSNorm) cannot take style 'layernorm_parallel'" in message
    assert "rmsnorm_parallel" in message and "\n" not in message


def test_the_auto_planner_puts_a_layernorm_between_column_and_row_in_the_new_style():
    """Its mean and variance held in the planner's perturbed probes, the norm spreads no share to the others; ESM C,
    given no plan, is planned as Hugging Face's plan with its additions plans it."""
    from tp_train.plan.deciding.resolve import plan_additions
    from tp_train.tools.zoo import build_family

    model = LayerNormedLM()
    del model.tp_plan
    plan = tp_train.infer_plan(model, tensor_parallel_size=2)
    assert {key: plan[key] for key in PLAN} == PLAN
    torch.manual_seed(0)
    esmc = build_family("masked-lm", "esmc")
    inferred = tp_train.infer_plan(esmc, tensor_parallel_size=2)
    own = {**esmc._tp_plan, **plan_additions(esmc)}
    assert {key: inferred[key] for key in own} == own
    assert inferred["esmc.layers.*.self_attn.q_norm"] == "layernorm_parallel"


def test_a_layernorm_in_the_residual_stream_is_not_taken_for_one_between_column_and_row():
    """SigLIP 2's first pre-norm reads its Linear patch embedding plus a position-embedding parameter: held in the
    probes, it made the patch embedding look like a column of the first block's projections (refused: "parameter of
    'vision_model.embeddings.position_embedding' ... acts on the features split"). Only a LayerNorm reading Linear
    outputs alone is held, and SigLIP 2 is planned as before."""
    from tp_train.tools.zoo import build_family

    torch.manual_seed(0)
    plan = tp_train.infer_plan(build_family("image-classification", "siglip2"), tensor_parallel_size=2)
    assert plan["vision_model.encoder.layers.*.self_attn.q_proj"] == "colwise"
    assert "layernorm_parallel" not in plan.values()


def _float64_norms(rank, world_size):
    """A LayerNorm and an RMS norm over features split across the ranks, on float64 inputs: the corrected outputs
    against the whole norms' (no statistic rounded to float32 on the way)."""
    import torch.distributed as dist

    from tp_train.parallel.norm import ParallelLayerNormRegion, ParallelRMSNormRegion

    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=torch.float64) * 3 + 1
    errors = {}
    for name, whole, region in (
        ("layernorm", nn.LayerNorm(16, dtype=torch.float64), ParallelLayerNormRegion(dist.group.WORLD, 1e-5)),
        ("rmsnorm", nn.RMSNorm(16, eps=1e-5, dtype=torch.float64), ParallelRMSNormRegion(dist.group.WORLD, 1e-5)),
    ):
        with torch.no_grad():
            for parameter in whole.parameters():
                parameter.uniform_(0.5, 1.5)
        local = type(whole)(16 // world_size, eps=1e-5, dtype=torch.float64)
        with torch.no_grad():
            for own, full in zip(local.parameters(), whole.parameters(), strict=True):
                own.copy_(full.chunk(world_size)[rank])
        region.install(local)
        output = local(x.chunk(world_size, dim=-1)[rank])
        errors[name] = (output - whole(x).chunk(world_size, dim=-1)[rank]).abs().max().item(), output.dtype
    return errors


def test_norms_over_split_features_keep_float64():
    for errors in run_on_ranks(_float64_norms, 2):
        for name, (error, dtype) in errors.items():
            assert dtype == torch.float64 and error <= 1e-12, (name, error, dtype)
