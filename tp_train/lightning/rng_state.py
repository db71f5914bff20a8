"""Random-number state in checkpoints, so that a resumed run draws the same dropout masks as one never stopped."""

from __future__ import annotations

import lightning as L
import torch.distributed as dist
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning.pytorch.utilities import rank_zero_warn

from tp_train.plan.parallelize import attached

KEY = "tp_train_rng_states"


class RandomStateCheckpoint(L.Callback):
    """Saves the generators of every rank (torch, CUDA, numpy, Python, and each sharded model's
    `TensorParallelRNG` streams) with each checkpoint and restores this rank's on resume, right before the first
    training batch (what runs between loading and training, e.g. a FLOP count's forward, may draw numbers)."""

    def __init__(self) -> None:
        self._pending: dict | None = None

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        state = {
            "global": _collect_rng_states(include_cuda=True),
            "tensor_parallel": [rng.get_state() for rng in attached(pl_module, "tp_rng")],
        }
        if dist.is_available() and dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, state)  # every rank saves the checkpoint together
        else:
            states = [state]
        checkpoint[KEY] = states

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        states = checkpoint.get(KEY)
        if states is None:
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(
                f"the checkpoint holds random states of {len(states)} ranks, this run has {trainer.world_size}: "
                f"dropout masks after resuming will differ from those of a run never stopped"
            )
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if self._pending is None:
            return
        state, self._pending = self._pending, None
        for rng, streams in zip(attached(pl_module, "tp_rng"), state["tensor_parallel"], strict=False):
            rng.set_state(streams)
        _set_rng_states(state["global"])  # after the streams: they also set the default generator
