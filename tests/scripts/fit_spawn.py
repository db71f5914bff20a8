"""Trains with TensorParallelStrategy's spawn start method (as from a notebook or pytest) and prints the losses."""

import json

import lightning as L
import torch

from tests.lightning_helpers import GLOBAL_BATCH, LitLM, StepRecorder, token_data
from tp_train import TensorParallelStrategy


class PrintLosses(L.Callback):
    def on_train_end(self, trainer, pl_module):
        recorder = next(c for c in trainer.callbacks if isinstance(c, StepRecorder))
        if trainer.is_global_zero:
            print("LOSSES", json.dumps(recorder.losses), flush=True)


if __name__ == "__main__":
    torch.manual_seed(0)
    trainer = L.Trainer(
        strategy=TensorParallelStrategy(tensor_parallel_size=2, start_method="spawn"),
        accelerator="cpu",
        devices=2,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=[StepRecorder(), PrintLosses()],
    )
    trainer.fit(LitLM(), torch.utils.data.DataLoader(token_data(3), batch_size=GLOBAL_BATCH))
