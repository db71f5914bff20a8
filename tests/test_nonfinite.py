"""A NaN on one rank only (rank 1's shard of a gradient, after the data-parallel all-reduce) stops every rank, or is
skipped by every rank, at the same step; after a skip the replicas stay identical and equal a run that never saw
that batch. Real Trainers on dp=2 x tp=2 gloo ranks."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Subset

from tests.distributed import run_on_ranks
from tests.lightning_helpers import GLOBAL_BATCH, LitLM, fit, make_trainer, token_data
from tp_train import TensorParallelMixedPrecision, full_state_dict
from tp_train.errors import NonFiniteError
from tp_train.lightning.nonfinite import NonFiniteGuard

TP, STEPS, BAD_STEP, BAD_RANK = 2, 6, 3, 1


class _NaNInShard(L.Callback):
    """Rank `BAD_RANK` puts a NaN in its shard of a row-parallel weight's gradient at step `BAD_STEP`."""

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == BAD_RANK and trainer.global_step == BAD_STEP:
            pl_module.model.layers[0].mlp.down.weight.grad[0, 0] = float("nan")


def _train(batches: list[int], steps: int, guard: NonFiniteGuard | None, inject: bool):
    """Trains LitLM on the global batches `batches` of `token_data(STEPS)`, in order, each split over the
    data-parallel ranks here (Lightning's sampler would shuffle, in an order that depends on the dataset size)."""
    torch.manual_seed(0)
    module = LitLM()
    callbacks = [callback for callback in (_NaNInShard() if inject else None, guard) if callback is not None]
    # Clipping on: after a skip it runs over no gradients, on every rank (it is a tensor-parallel collective).
    trainer = make_trainer(TP, callbacks, max_steps=steps, use_distributed_sampler=False, gradient_clip_val=0.5)
    dp, dp_rank = dist.get_world_size() // TP, dist.get_rank() // TP
    local = GLOBAL_BATCH // dp
    rows = [batch * GLOBAL_BATCH + dp_rank * local + i for batch in batches for i in range(local)]
    error = None
    try:
        trainer.fit(module, DataLoader(Subset(token_data(STEPS), rows), batch_size=local))
    except NonFiniteError as raised:
        error = str(raised)
    params = {name: param.detach().clone() for name, param in module.named_parameters()}
    full = full_state_dict(module.model, trainer.strategy.tensor_parallel_group)
    return {"error": error, "global_step": trainer.global_step, "local": params, "full": full}


def _runs(rank, world_size):
    every = list(range(STEPS))
    skip = NonFiniteGuard("skip")
    return {
        "stop": _train(every, STEPS, NonFiniteGuard("stop"), inject=True),
        "skip": {**_train(every, STEPS, skip, inject=True), "skipped": skip.skipped_steps},
        "reference": _train([b for b in every if b != BAD_STEP], STEPS - 1, NonFiniteGuard("skip"), inject=False),
        "unguarded": _train(every, STEPS, None, inject=True),
        "fp16": _fp16_overflow(),
    }


def _fp16_overflow():
    """fp16: the sharded grad scaler skips a step with a non-finite gradient on every rank by itself; the guard
    (here set to stop) leaves such steps to it."""
    guard = NonFiniteGuard("stop")
    plugins = [TensorParallelMixedPrecision("16-mixed", "cpu")]
    _, recorder = fit(TP, STEPS, module_kwargs=dict(lr=3e-3), callbacks=[_NaNInShard(), guard], plugins=plugins)
    return {"skipped": recorder.skipped, "scales": recorder.scales, "guard_skipped": guard.skipped_steps}


@pytest.fixture(scope="module")
def runs():
    return run_on_ranks(_runs, 4, timeout=300)


def _replicas_identical(runs, name) -> bool:
    """Ranks r and r + TP hold the same tensor-parallel shard in different data-parallel replicas."""
    return all(
        torch.equal(runs[rank][name]["local"][key], runs[rank + TP][name]["local"][key])
        for rank in range(TP)
        for key in runs[rank][name]["local"]
    )


@pytest.mark.slow
def test_nan_on_one_rank_stops_every_rank_at_that_step(runs):
    for rank, result in enumerate(runs):
        assert result["stop"]["error"] is not None, f"rank {rank} did not stop"
        assert f"non-finite values at global step {BAD_STEP} (rank {BAD_RANK}: gradients)" in result["stop"]["error"]
        assert "\n" not in result["stop"]["error"]
        assert result["stop"]["global_step"] == BAD_STEP


@pytest.mark.slow
def test_nan_on_one_rank_is_skipped_by_every_rank_and_replicas_stay_identical(runs):
    for rank, result in enumerate(runs):
        assert result["skip"]["error"] is None and result["skip"]["skipped"] == [BAD_STEP], rank
        assert result["skip"]["global_step"] == STEPS
    assert _replicas_identical(runs, "skip")
    skipped, reference = runs[0]["skip"]["full"], runs[0]["reference"]["full"]
    for key, tensor in reference.items():
        assert torch.isfinite(skipped[key]).all(), key
        assert torch.equal(skipped[key], tensor), f"{key} differs by {(skipped[key] - tensor).abs().max()}"


@pytest.mark.slow
def test_without_the_guard_the_nan_reaches_one_replica_only(runs):
    """The negative control: the injected NaN does reach the weights and splits the replicas."""
    assert not _replicas_identical(runs, "unguarded")
    assert not torch.isfinite(runs[BAD_RANK]["unguarded"]["local"]["model.layers.0.mlp.down.weight"]).all()


@pytest.mark.slow
def test_fp16_overflow_is_left_to_the_grad_scaler(runs):
    for rank, result in enumerate(runs):
        fp16 = result["fp16"]
        assert fp16["skipped"] == [step == BAD_STEP for step in range(STEPS)], rank  # ran on, skipping step 3 only
        assert fp16["scales"][BAD_STEP] == fp16["scales"][BAD_STEP - 1] / 2
        assert fp16["guard_skipped"] == []
