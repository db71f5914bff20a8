"""The auto-planner's probe forward and verification run a model the way training does, without a generation cache:
Hugging Face models whose default cache cannot be built from their layers (the decoder of BART used as a causal
LM, a hybrid whose first layers are all linear attention) are planned, sharded and match the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL
from tp_train.plan.checking.verify import unsharded_skeleton
from tp_train.plan.probe import forward_without_cache
from tp_train.tools.zoo import VOCAB, tiny_config

# Both fail unsharded when called with the default cache: BART's decoder, deeper than its encoder, indexes a cache
# sized by the encoder's layers, and two linear-attention layers leave Qwen3.5's hybrid cache no attention layer to
# read the sequence length from.
CACHE_FAMILIES = ("bart", "qwen3_5_text")
OVERRIDES = {"bart": {"decoder_layers": 4}}
# Matrices kept whole on purpose: BART's cross-attention (no encoder here, so it never runs: a third of each tiny
# decoder layer's matrices, so a rank holds 2/3 of them at tp=2), Qwen3.5's depthwise conv.
BLOCK_REL_TOL = {"bart": 1 / 3, "qwen3_5_text": 0.05}


def _build(model_type: str) -> nn.Module:
    from models.hf import hugging_face_causal_lm

    torch.manual_seed(0)
    config = {**tiny_config(model_type), **OVERRIDES.get(model_type, {})}
    return hugging_face_causal_lm(model_type, config=config).eval()


def _logits(model, idx):
    return forward_without_cache(model, idx).logits


def _cache_families_parity(rank, world_size):
    torch.set_num_threads(1)
    return {
        name: parity_errors(_build(name), _logits, VOCAB, parallelize_kwargs=dict(verify=True))
        for name in CACHE_FAMILIES
    }


def test_these_models_fail_with_their_default_cache():
    idx = torch.randint(0, VOCAB, (1, 8))
    for name in CACHE_FAMILIES:
        model = _build(name)
        with pytest.raises((IndexError, ValueError)):
            model(idx)
        assert forward_without_cache(model, idx).logits.shape == (1, 8, VOCAB)


def test_models_whose_default_cache_cannot_be_built_are_auto_planned_and_match_unsharded():
    for rank, results in enumerate(run_on_ranks(_cache_families_parity, 2, timeout=300)):
        for name, errors in results.items():
            assert_parity(errors, 2, rank, ATOL, block_rel_tol=BLOCK_REL_TOL[name])


class _KeepsState(nn.Module):
    """A module that leaves its last output on itself as a plain attribute, as RecurrentGemma's RG-LRU does."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.state = None

    def forward(self, x):
        self.state = self.linear(x)
        return self.state


def test_the_unsharded_skeleton_copies_state_a_forward_left_with_autograd_history():
    model = _KeepsState()
    model(torch.ones(2, 4))
    assert model.state.grad_fn is not None
    skeleton = unsharded_skeleton(model)
    assert skeleton.linear.weight.is_meta and skeleton.state.grad_fn is None
    assert torch.equal(skeleton.state, model.state.detach())


def test_split_sizes_are_read_through_an_element_wise_step():
    """DBRX clamps its fused q/k/v projection's output before splitting it into [q; k; v] of unequal widths: the
    sizes are read through the clamp, as straight off the projection."""
    from tp_train.plan.probe import split_sizes

    projection = nn.Linear(8, 16)
    output = projection(torch.randn(2, 3, 8))
    for fused in (output, output.clamp(-8.0, 8.0)):
        q, k, v = fused.split([8, 4, 4], dim=-1)
        assert split_sizes(output, torch.cat([q, k * 2, v], dim=-1)) == (8, 4, 4)
