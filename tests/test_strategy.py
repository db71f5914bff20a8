"""TensorParallelStrategy in real Lightning Trainers on gloo ranks: the same training at any dp x tp, the true
global gradient norm, fp16 steps skipped on every rank together, and models built on the meta device. (Clipping
against plain Lightning: test_clipping; every precision: test_precision.)"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit, meta_built
from tests.test_parallelize import SwiGLUModel
from tp_train import TensorParallelMixedPrecision

STEPS = 10
CLIP = 0.5  # below the gradient norm of this model at init, so clipping is active


def _train(rank, world_size, tp, build_in_configure_model=False, build=SwiGLUModel):
    _, recorder = fit(
        tp,
        STEPS,
        module_kwargs=dict(build_in_configure_model=build_in_configure_model, build=build),
        gradient_clip_val=CLIP,
        gradient_clip_algorithm="norm",
    )
    return recorder.losses, recorder.clip_norms, recorder.local_norms


@pytest.fixture(scope="module")
def unsharded_run():
    """Plain Lightning on one device: torch's clipping, and the true norm before clipping (`local_norms`)."""
    return run_on_ranks(_train, 1, None)[0]


@pytest.mark.parametrize("world_size,tp", [(2, 2), (4, 4), (4, 2)], ids=["tp2", "tp4", "dp2xtp2"])
def test_same_losses_and_clip_norm_at_any_dp_x_tp(world_size, tp, unsharded_run):
    ref_losses, _, ref_norms = unsharded_run
    assert len(ref_losses) == STEPS
    assert ref_norms[0] > CLIP  # clipping was active
    for losses, clip_norms, _ in run_on_ranks(_train, world_size, tp, timeout=300):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)  # the strategy clipped by the true global norm


def test_model_built_in_configure_model_on_meta_trains_the_same_at_tp2():
    # plain Lightning, the model built in __init__ with the weights a meta build starts from (drawn per parameter
    # name, not in an eager build's order: tests/test_initial_weights.py checks them)
    ref = run_on_ranks(_train, 1, None, False, meta_built(SwiGLUModel))[0]
    for losses, _, _ in run_on_ranks(_train, 2, 2, True):
        assert losses == pytest.approx(ref[0], abs=1e-5)


class _InjectOverflow:
    """On one rank only, at one step, make a gradient infinite after backward."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def __call__(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(float("inf"))


def _fp16_with_overflow(rank, world_size):
    import lightning as L

    inject = _InjectOverflow(rank=1, step=3)
    callback = L.Callback()
    callback.on_after_backward = inject
    _, recorder = fit(
        2,
        STEPS,
        module_kwargs=dict(lr=3e-3),
        callbacks=[callback],
        plugins=[TensorParallelMixedPrecision("16-mixed", "cpu")],
    )
    return recorder.losses, recorder.scales, recorder.skipped


def _plain_fp32(rank, world_size):
    return fit(None, STEPS, module_kwargs=dict(lr=3e-3))[1].losses


def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    fp32_losses = run_on_ranks(_plain_fp32, 1)[0]
    results = run_on_ranks(_fp16_with_overflow, 2, timeout=300)
    for losses, scales, skipped in results:
        assert skipped == [False, False, False, True] + [False] * (STEPS - 4)
        assert scales[3] == scales[2] / 2  # the scale backs off together
        assert all(torch.isfinite(torch.tensor(losses)))
        # Before the overflow's skipped update, fp16 at tp=2 follows plain Lightning in fp32 (see test_precision).
        assert losses[:4] == pytest.approx(fp32_losses[:4], abs=1e-3)
    assert results[0][1] == results[1][1]
