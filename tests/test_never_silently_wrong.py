"""A plan that would compute another function is made right or refused, never trained silently.

- A swapped module keeps what its class did: an embedding subclass that scales its output (as Gemma's does) shards
  with its scale; a subclass whose forward bypasses `super().forward` and computes something else, or whose
  addition cannot run on a shard, is refused in one line naming the module and its class.
- A parameter two modules share is split alike on both: a tied head planned alone brings its embedding along; a
  tie split two ways is refused in one line naming both modules.
- A plan that shards no block (a head-only plan, as LFM2's and HunYuan's) is completed by the auto-planner.
- Verification runs for every plan by default, Hugging Face's included.
- Hugging Face families with those shapes (Gemma's scaled embedding and tied head, LFM2's and HunYuan's head-only
  plans) match the unsharded model at tp 1, 2 and 4 with no plan given.
"""

from __future__ import annotations

import contextlib
import copy
import io
from functools import partial

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, next_token_loss, parity_of_each
from tests.test_parallelize import ATOL, VOCAB, SwiGLUModel, _hf_gpt2
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan


class ScaledEmbedding(nn.Embedding):
    """An embedding whose subclass multiplies the lookup by a scale, the way Gemma's does."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float):
        super().__init__(num_embeddings, embedding_dim)
        self.register_buffer("scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.scale


class RawScaledEmbedding(nn.Embedding):
    """The same scale, computed without `super().forward`: no sharded lookup can run inside it."""

    def forward(self, ids):
        return F.embedding(ids, self.weight) * 2.0


class FeatureScaledLinear(nn.Linear):
    """A Linear whose subclass scales each output feature: the gain spans features a column split divides."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, out_features))

    def forward(self, x):
        return super().forward(x) * self.gain


def _scaled_embedding_model():
    model = SwiGLUModel()  # its tp_plan shards 'embed' with embedding_rowwise
    model.embed = ScaledEmbedding(VOCAB, 32, scale=5.0)
    return model


def _tied(model):
    model.head.weight = model.embed.weight
    return model


def _tied_head_only_plan_model():
    """Blocks and a head tied to the embedding, with a `tp_plan` that names only the head (as LFM2's)."""
    model = _tied(SwiGLUModel())
    model.tp_plan = {"head": "colwise_gather_output"}
    return model


def _logits(model, idx):
    return model(idx)


# ------------------------------------------------------------------------------------- refusals before sharding


def test_a_tie_split_two_ways_is_refused_in_one_line_naming_both_modules():
    plan = {**SwiGLUModel.tp_plan, "head": "colwise"}  # the head split plainly, its tied embedding by vocabulary
    with pytest.raises(ValueError) as error:
        match_plan(_tied(SwiGLUModel()), plan, tp=1)  # tp=1: a vocabulary of 101 splits no other way plainly
    message = str(error.value)
    assert "\n" not in message
    assert "'embed.weight' is the same parameter as 'head.weight'" in message
    assert "vocabulary in 'embed' but colwise in 'head'" in message


def test_a_tie_the_plan_shards_on_one_side_only_is_refused_when_the_other_side_cannot_follow():
    model = _tied(SwiGLUModel())
    plan = {**SwiGLUModel.tp_plan, "embed": "replicate"}  # the embedding kept whole on purpose, the head sharded
    with pytest.raises(ValueError, match="'head.weight' is the same parameter as 'embed.weight'.* whole in 'embed'"):
        match_plan(model, plan, tp=2)


def test_a_sharded_head_brings_its_tied_embedding_along():
    planned = {
        entry.name: entry.style for entry in match_plan(_tied(SwiGLUModel()), {"head": "colwise_gather_output"}, 2)
    }
    assert planned == {"embed": "embedding_rowwise", "head": "colwise_gather_output"}


def test_a_plan_that_shards_no_block_is_completed_by_the_auto_planner():
    plan, source = resolve_plan(_tied_head_only_plan_model(), tensor_parallel_size=2)
    assert source == "SwiGLUModel.tp_plan, completed by the auto-planner"
    assert plan["head"] == "colwise_gather_output" and plan["embed"] == "embedding_rowwise"
    assert plan["layers.*.mlp.down"] == "rowwise" and plan["layers.*.attn.q"] == "colwise"
    # A plan that does shard the blocks is taken as it is.
    assert resolve_plan(SwiGLUModel(), tensor_parallel_size=2) == (SwiGLUModel.tp_plan, "SwiGLUModel.tp_plan")


class _UntracedBlock(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        with torch.no_grad():  # no autograd history: the probe cannot see where `up` feeds
            hidden = self.up(x)
        return x + self.down(F.gelu(hidden))


class _UntracedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList([_UntracedBlock()])

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_linear_without_an_autograd_graph_is_a_one_line_refusal_not_a_crash():
    with pytest.raises(ValueError) as error:
        tp_train.infer_plan(_UntracedModel(), 2)
    message = str(error.value)
    assert "\n" not in message
    assert "cannot plan 'layers.0.up' (Linear 32->64): its output has no autograd graph" in message


# ------------------------------------------------------------------------------------------------- on gloo ranks


def _hf_family(model_type: str):
    from models.hf import hugging_face_causal_lm

    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    # Eval mode: BioGPT's and XGLM's configs carry dropout, whose masks no two models draw alike.
    return hugging_face_causal_lm(model_type, config=sizes).eval()


# Gemma-family models (Hugging Face's plan, a scaled embedding tied to the head), LFM2 (a head-only plan, tied) and
# HunYuan (a head-only plan, untied); BioGPT and XGLM (no plan: auto-planned, a scaled embedding).
HF_FAMILIES = ["gemma", "gemma2", "gemma3_text", "vaultgemma", "lfm2", "hunyuan_v1_dense", "biogpt", "xglm"]


def _hf_logits(model, idx):
    return model(idx).logits


PARITY_MODELS = {
    **{model_type: (partial(_hf_family, model_type), _hf_logits) for model_type in HF_FAMILIES},
    "scaled_embedding": (_scaled_embedding_model, _logits),
    "tied_head_only": (_tied_head_only_plan_model, _logits),
}


def _parity_cases(rank, world_size):
    return parity_of_each(PARITY_MODELS)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity_cases, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(PARITY_MODELS))
def test_sharded_with_no_plan_given_matches_unsharded(parity_results, name):
    tp, results = parity_results
    for rank, result in enumerate(results):
        assert_parity(result[name], tp, rank, atol=ATOL)


def _tied_head_alone(rank, world_size):
    """A tied pair whose head alone is given as the plan: the embedding is sharded with it; losses as unsharded."""
    torch.manual_seed(0)
    reference = _tied(SwiGLUModel())
    model = tp_train.parallelize(copy.deepcopy(reference), plan={"head": "colwise_gather_output"})
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    losses = []
    for _ in range(3):
        pair = [next_token_loss(m(idx), idx) for m in (reference, model)]
        for loss, optimizer in zip(pair, optimizers, strict=True):
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        losses.append(abs(pair[0].item() - pair[1].item()))
    held = sum(p.numel() for p in model.parameters()) / sum(p.numel() for p in reference.parameters())
    return type(model.embed).__name__, model.head.weight is model.embed.weight, losses, held


@pytest.mark.slow
def test_a_tied_head_given_alone_shards_its_embedding_too():
    for name, tied, losses, held in run_on_ranks(_tied_head_alone, 2, timeout=300):
        assert name == "VocabParallelEmbedding" and tied
        assert max(losses) < ATOL, losses
        assert held < 1.0, held  # the shared table is held once, as a shard


def _refusals(rank, world_size):
    results = {}
    # A Hugging Face plan is verified by default: GPT-2's fused [q; k; v] split plainly, as if its own plan said so.
    torch.manual_seed(0)
    model = _hf_gpt2()
    model._tp_plan = {**resolve_plan(_hf_gpt2())[0], "transformer.h.*.attn.c_attn": "colwise"}
    for name, build, plan in [
        ("hugging_face_plan", lambda: model, None),
        ("feature_scaled_linear", _feature_scaled_model, None),
        ("raw_scaled_embedding", _raw_scaled_embedding_model, None),
    ]:
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                tp_train.parallelize(build(), plan=plan)
            results[name] = "no error"
        except tp_train.PlanVerificationError as error:
            results[name] = str(error)
    return results


def _raw_scaled_embedding_model():
    model = SwiGLUModel()
    model.embed = RawScaledEmbedding(VOCAB, 32)
    return model


def _feature_scaled_model():
    model = SwiGLUModel()
    model.layers[0].mlp.gate_up = FeatureScaledLinear(32, 96)
    return model


@pytest.mark.slow
def test_verification_runs_for_every_plan_and_names_the_module_that_differs():
    for result in run_on_ranks(_refusals, 2, timeout=300):
        message = result["hugging_face_plan"]
        assert "\n" not in message and message.startswith("tensor-parallel plan verification failed"), message
        assert "'transformer.h.0.attn.c_attn': 'colwise'" in message
        message = result["feature_scaled_linear"]
        assert "\n" not in message, message
        assert "module 'layers.0.mlp.gate_up' (FeatureScaledLinear) sharded as" in message, message
        message = result["raw_scaled_embedding"]
        assert "\n" not in message, message
        assert "module 'embed' (RawScaledEmbedding) sharded as VocabParallelEmbedding differs from it by" in message
