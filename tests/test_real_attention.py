"""Attention written the way real projects write it is sharded by heads, with no plan given, and matches the
unsharded model at tp 2 and 4 (logits, gradients, 3 steps of losses; each rank holding 1/tp of every block matrix):
head counts in a config object the whole model shares (litgpt; its fused grouped-query projection with unequal
[q; k; v] sections, and laid out per group), in einops-style layers and patterns (x-transformers), and derived from
the input's width (nanoGPT). An attention that no local view can fix (a literal head count) is kept whole while the
rest is sharded, with one printed line; given a plan that shards it anyway, verification names the module whose
forward failed."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import math

import pytest
import torch

import tp_train
from tests import attention_styles as styles
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL
from tp_train.plan.local_view import LocalView, LocalWidth, apply_local_view, parse_attention_style

MODELS = {
    "litgpt_config_gqa": (lambda: styles.litgpt_style(), "attention(config.n_head, config.n_query_groups)"),
    "litgpt_interleaved_groups": (
        lambda: styles.litgpt_style(interleaved=True),
        "attention(config.n_head, config.n_query_groups)",
    ),
    "einops_patterns": (styles.einops_style, "attention(heads, split_q_heads.axes_lengths.h)"),
    "nanogpt_width": (styles.nanogpt_style, "attention(n_head, n_embd, input_width)"),
}
# models whose blocks get different views (no one `h.*.attn` entry)
UNPATTERNED = {"masked_every_second_block": (styles.masked_every_second_block, None)}
if importlib.util.find_spec("einops") is not None:  # not one of our dependencies: tested where installed
    MODELS["real_einops"] = (styles.real_einops_style, "attention(heads, split_q_heads.axes_lengths.h)")


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_auto_planner_finds_where_the_head_counts_are(name, tp):
    build, expected = MODELS[name]
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build(), tensor_parallel_size=tp)
    assert plan["h.*.attn"] == expected, plan
    assert not plan.notes


@pytest.mark.parametrize("tp", [2, 4])
def test_each_block_gets_the_view_its_own_call_needs(tp):
    """Blocks alike but for what they are passed (a mask every second block, Donut-Swin's shifted windows) each get
    the view their call needs: only the masked one reads its head count."""
    plan = tp_train.infer_plan(styles.masked_every_second_block(), tensor_parallel_size=tp)
    assert (plan["h.0.attn"], plan["h.1.attn"]) == ("attention", "attention(masked_heads)"), plan


def test_the_fused_grouped_query_projection_is_split_by_its_unequal_sections():
    plan = tp_train.infer_plan(styles.litgpt_style(), tensor_parallel_size=2)
    assert plan["h.*.attn.attn"] == "fused_qkv_colwise(64,32,32)"  # [q (8 heads); k (4 groups); v (4 groups)] x 8
    assert tp_train.infer_plan(styles.litgpt_style(interleaved=True), 4)["h.*.attn.attn"] == "colwise"


def test_the_shared_config_stays_global():
    """Each attention gets its own local view; the config the rest of the model reads is untouched."""
    from tp_train.plan.local_view import apply_local_view, parse_attention_style

    model = styles.litgpt_style()
    attention = model.h[0].attn
    shared = attention.config
    apply_local_view(attention, parse_attention_style("attention(config.n_head, config.n_query_groups)"), 2, 0)
    assert (attention.config.n_head, attention.config.n_query_groups) == (4, 2)
    assert (shared.n_head, shared.n_query_groups) == (8, 4) and model.h[1].attn.config is shared


def test_a_local_width_view_reports_the_local_width_and_computes_on_the_whole_tensor():
    x = torch.randn(2, 3, 8, requires_grad=True)
    view = LocalWidth.of(x, 4)
    assert view.size() == (2, 3, 2) and view.shape[-1] == 2 and view.size(-1) == 2
    (view * 3).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


def test_a_local_width_view_stays_local_through_a_transpose_that_keeps_the_features_last():
    """Longformer's attention reads its width after `hidden_states.transpose(0, 1)` (time-major): still local."""
    view = LocalWidth.of(torch.randn(2, 3, 8), 4)
    assert view.transpose(0, 1).size() == (3, 2, 2) and torch.transpose(view, 1, 0).shape == (3, 2, 2)
    assert view.transpose(1, 2).size() == (2, 8, 3) and view.transpose(-1, 0).shape == (8, 3, 2)  # features moved
    assert (view + 1).shape == (2, 3, 8)  # any other operation: a plain tensor


class _ReshapesByInputWidth(torch.nn.Module):
    """PVT v2's pattern: the input's width reshapes the whole input, then a rank's (half-width) output."""

    def forward(self, x):
        B, N, C = x.shape
        whole = x.permute(0, 2, 1).reshape(B, C, 2, N // 2)  # holds its tensor at the whole width: as written
        return whole.flatten(2).transpose(1, 2)[..., : C // 2].reshape(B, N, C), whole.view(B, C, N)


def test_local_reshapes_give_the_local_width_only_to_a_reshape_that_cannot_hold_its_tensor():
    module = _ReshapesByInputWidth()
    apply_local_view(module, LocalView(local_reshapes=True), tp=2, rank=0)
    x = torch.randn(2, 4, 8)
    local, whole = module(x)
    assert local.shape == (2, 4, 4) and torch.equal(local, x[..., :4])
    assert whole.shape == (2, 8, 4)
    assert LocalView(("heads",), local_reshapes=True).style() == "attention(heads, local_reshapes)"
    assert parse_attention_style("attention(heads, local_reshapes)") == LocalView(("heads",), local_reshapes=True)


def _logits(model, idx):
    return model(idx)


def _parity(rank, world_size):
    results = {}
    for name, (build, _) in {**MODELS, **UNPATTERNED, "literal_heads": (styles.literal_heads, None)}.items():
        torch.manual_seed(0)
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            results[name] = parity_errors(build(), _logits, vocab_size=styles.VOCAB)
        results[name]["printed"] = printed.getvalue()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", [*MODELS, *UNPATTERNED])
def test_attention_as_projects_write_it_matches_unsharded(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        errors = dict(results[name])
        errors.pop("printed")
        assert_parity(errors, tp, rank, ATOL)


@pytest.mark.slow
def test_an_attention_no_view_can_localise_is_kept_whole_and_the_rest_sharded(parity_results):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        errors = dict(results["literal_heads"])
        printed = errors.pop("printed")
        notes = [line for line in printed.splitlines() if "kept whole" in line]
        if rank == 0:
            assert len(notes) == 1, printed
            assert "attention 'h.*.attn' kept whole on every rank: no view of its head counts" in notes[0]
            assert "shape '[2, 8, 4, 8]' is invalid" in notes[0] and "63% of the parameters are sharded" in notes[0]
        else:
            assert not notes
        block_fraction, _ = errors.pop("block_fraction"), errors.pop("shard_fraction")
        # The MLP matrices (2 of the block's 3 parameter-weighted parts) are sharded; attention's are whole.
        attention, mlp = 4 * 32 * 32, 2 * 32 * 64
        assert math.isclose(block_fraction, (attention + mlp / tp) / (attention + mlp)), block_fraction
        worst = max(errors, key=errors.get)
        assert errors[worst] < ATOL, f"rank {rank}: {worst} differs by {errors[worst]:.3g}"


def _forced_plan(rank, world_size):
    torch.manual_seed(0)
    model = styles.literal_heads()
    plan = {
        "h.*.attn": "attention",
        **{f"h.*.attn.{name}": "colwise" for name in "qkv"},
        "h.*.attn.o": "rowwise",
        "h.*.mlp.0": "colwise",
        "h.*.mlp.2": "rowwise",
    }
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            tp_train.parallelize(model, plan=plan)
    except tp_train.PlanVerificationError as error:
        return str(error)
    return "no error"


@pytest.mark.slow
def test_verification_names_the_innermost_module_whose_forward_failed():
    for message in run_on_ranks(_forced_plan, 2, timeout=300):
        assert "\n" not in message, message
        assert "the sharded model fails on a probe batch in the forward of 'h.0.attn'" in message, message
        assert "shape '[2, 8, 4, 8]' is invalid" in message and "'h.0.attn.q': 'colwise'" in message, message
