"""Sharded data parallelism (`TensorParallelStrategy(data_parallel="fsdp")`, torch's FSDP2 over the data-parallel
axis) at dp2 x tp2 on gloo ranks, and gradient accumulation under dp x tp in both modes: the losses of plain
Lightning on one device with the same global batch, a quarter of the model state per rank, and no data-parallel
reduction on the micro-batches before the last."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit, fit_plain
from tests.test_parallelize import SwiGLUModel
from tp_train.parallel.sharding import local_part
from tp_train.tools.memory import ADAMW_STATES, parameters_per_rank

STEPS = 10
CLIP = 0.5  # below the gradient norm at init, so clipping is active
CLIPPING = dict(gradient_clip_val=CLIP, gradient_clip_algorithm="norm")


class _GradientSync(L.Callback):
    """After each micro-batch's backward: does this rank hold (sharded) gradients, and are they the same on its
    data-parallel peers (a sum over this rank's gradient elements, compared across the dp group)?"""

    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []

    def on_after_backward(self, trainer, pl_module):
        grads = [local_part(p.grad) for p in pl_module.parameters() if p.grad is not None]
        total = torch.stack([g.double().sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.double)
        peers = [torch.zeros_like(total) for _ in range(trainer.strategy.data_parallel_size)]
        dist.all_gather(peers, total, group=trainer.strategy.data_parallel_group)
        self.seen.append((bool(grads), all(torch.equal(peers[0], peer) for peer in peers)))


def _train(rank, world_size, data_parallel, accumulate):
    sync = _GradientSync()
    trainer, recorder = fit(
        2, STEPS, data_parallel=data_parallel, accumulate_grad_batches=accumulate, callbacks=[sync], **CLIPPING
    )
    losses = recorder.losses  # per micro-batch, each already divided by `accumulate` by Lightning
    step_losses = [sum(losses[i : i + accumulate]) for i in range(0, len(losses), accumulate)]
    module = trainer.lightning_module
    (optimizer,) = trainer.optimizers
    state = sum(local_part(p).numel() for p in module.parameters())
    state += sum(local_part(v).numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return step_losses, recorder.clip_norms[accumulate - 1 :: accumulate], sync.seen, state  # clipped at the last


@pytest.fixture(scope="module")
def plain_lightning():
    recorder = run_on_ranks(_plain, 1)[0]
    return recorder


def _plain(rank, world_size):
    recorder = fit_plain(STEPS, **CLIPPING)
    return recorder.losses, recorder.local_norms


def test_fsdp_dp2_tp2_trains_like_plain_lightning_with_a_quarter_of_the_state(plain_lightning):
    ref_losses, ref_norms = plain_lightning
    assert len(ref_losses) == STEPS and ref_norms[0] > CLIP
    results = run_on_ranks(_train, 4, "fsdp", 1, timeout=300)
    for losses, clip_norms, _, _ in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)  # each element counted once over dp and tp
    whole = sum(p.numel() for p in SwiGLUModel().parameters()) * (1 + ADAMW_STATES)
    measured = max(state for *_, state in results)
    predicted = parameters_per_rank(SwiGLUModel(), tp=2, dp=2, data_parallel="fsdp") * (1 + ADAMW_STATES)
    print(f"fsdp dp2 x tp2: {measured} of {whole} state elements per rank, predicted {predicted}")
    assert measured / whole <= 0.27
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_accumulating_two_micro_batches_is_one_big_batch(data_parallel, plain_lightning):
    ref_losses, ref_norms = plain_lightning
    for losses, clip_norms, seen, _ in run_on_ranks(_train, 4, data_parallel, 2, timeout=300):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)
        first, last = seen[0::2], seen[1::2]
        if data_parallel == "ddp":  # no_sync: each rank keeps its own micro-batch's gradients until the last
            assert first == [(True, False)] * STEPS and last == [(True, True)] * STEPS
        else:  # FSDP2 without gradient sync holds unsharded gradients, and reduce-scatters after the last
            assert first == [(False, True)] * STEPS and all(present for present, _ in last)
