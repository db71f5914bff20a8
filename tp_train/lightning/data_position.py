"""Resuming at the same sequence of the epoch when the batch is cut differently: another number of data-parallel
ranks or another batch size per rank (`parallel=auto` re-choosing the layout on another number of devices).

Every layout reads one epoch's order (`ResumableDistributedSampler`: a permutation of (seed, epoch), rank r taking
every dp-th index), so after n batches of b sequences on each of dp ranks the first n x b x dp sequences of the
order are trained, whatever dp is. A checkpoint records n and b x dp (`ResumableDataLoader.state_dict`); resumed
under another b' x dp', `DataPosition` turns n into n x b x dp / (b' x dp') batches, in the loader's state and in
Lightning's count of the epoch's batches (which decides where an accumulated optimizer step ends), before either is
restored. A position that is not a whole number of the new batches, or of its accumulated steps, is refused in one
line: the run would train a sequence twice or skip one, or end an optimizer step early.
"""

from __future__ import annotations

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback

from tp_train.errors import CheckpointError
from tp_train.lightning.resumable_loader import SEQUENCES_PER_BATCH

PROGRESS = "epoch_loop.batch_progress"  # Lightning's count of the batches run, in the fit loop's state
COUNTS = ("ready", "started", "processed", "completed")


class DataPosition(Callback):
    """Converts a checkpoint's position in the epoch to this run's batches (see the module docstring). The batch
    size per rank is the datamodule's `batch_size`; without one, nothing is converted."""

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        fit_loop = checkpoint.get("loops", {}).get("fit_loop", {})
        states = [s for s in fit_loop.get("state_dict", {}).get("combined_loader", []) if SEQUENCES_PER_BATCH in s]
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        if len(states) != 1 or PROGRESS not in fit_loop or not isinstance(batch_size, int):
            return
        state, replicas = states[0], (trainer.distributed_sampler_kwargs or {}).get("num_replicas", 1)
        saved, now = state[SEQUENCES_PER_BATCH], batch_size * replicas
        if saved == now:  # the same cut: the saved position is this run's (an epoch's last step may be partial)
            return
        sequences, step = state["batches"] * saved, now * trainer.accumulate_grad_batches
        if sequences % step:
            raise CheckpointError(
                f"the checkpoint stopped after {sequences} sequences of its epoch ({state['batches']} batches of "
                f"{saved} over the data-parallel ranks), not a whole number of this run's optimizer steps of {step} "
                f"(data.batch_size={batch_size} x {replicas} data-parallel ranks x "
                f"{trainer.accumulate_grad_batches} accumulated); resume with a batch per step that divides {sequences}"
            )
        shift = sequences // now - state["batches"]
        progress = fit_loop[PROGRESS]
        for counts in (progress["current"], progress["total"]):
            for key in COUNTS:
                counts[key] += shift
        state.update(batches=sequences // now, **{SEQUENCES_PER_BATCH: now})
