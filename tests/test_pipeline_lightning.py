"""Pipeline parallelism through Lightning: a LightningModule written for plain Lightning trains at pp=2 under
TensorParallelStrategy as it does on one device (10 steps, losses as logged and final parameters to 1e-5, with norm
clipping and padded targets uneven across microbatches), and bad pipeline arguments are refused in one line."""

from __future__ import annotations

import lightning.pytorch as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed import run_on_ranks
from tests.test_pipeline import batches, tiny_gpt
from tp_train import TensorParallelStrategy

STEPS = 10
CLIP = 0.5


class PlainLM(L.LightningModule):
    """Written for plain Lightning: the strategy's cross_entropy where there is one, self.log of the loss."""

    def __init__(self, n_layer: int) -> None:
        super().__init__()
        self.model = tiny_gpt(n_layer)

    def _loss(self, batch):
        ids, targets = batch
        logits = self.model(ids)
        if isinstance(self.trainer.strategy, TensorParallelStrategy):  # token-weighted across microbatches
            return self.trainer.strategy.cross_entropy(logits, targets)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class LoggedLoss(L.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []
        self.returned: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.logged.append(trainer.callback_metrics["train_loss"].item())
        self.returned.append(outputs["loss"].item())


def _fit(rank, world_size, n_layer, strategy_kwargs, accumulate=1):
    ids, targets = (torch.cat(parts) for parts in zip(*batches(STEPS), strict=True))
    data = DataLoader(TensorDataset(ids, targets), batch_size=ids.shape[0] // STEPS)
    module, recorder = PlainLM(n_layer), LoggedLoss()
    plain = strategy_kwargs is None
    trainer = L.Trainer(
        strategy="auto" if plain else TensorParallelStrategy(**strategy_kwargs),
        accelerator="cpu",
        devices=1 if plain else dist.get_world_size(),
        max_steps=STEPS // accumulate,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder],
        gradient_clip_val=CLIP if accumulate == 1 else None,  # unclipped: clipping would hide a gradient's scale
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,  # validation through the pipeline before its first training step
        val_check_interval=5,
        use_distributed_sampler=False,  # the batches in order, on one device as on both stages
    )
    held_out = DataLoader(TensorDataset(ids[:8] % 7, targets[:8]), batch_size=4)
    trainer.fit(module, data, held_out)
    (validated,) = trainer.validate(module, held_out, verbose=False)
    params = {name: p.detach().clone() for name, p in module.model.named_parameters(remove_duplicate=False)}
    norm = trainer.strategy.precision_plugin.last_grad_norm if not plain else None
    return recorder.logged, recorder.returned, params, None if norm is None else norm.item(), validated["val_loss"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule,microbatches,accumulate", [("1f1b", 4, 1), ("gpipe", 2, 1), ("1f1b", 4, 2)])
def test_pipeline_through_lightning_equals_plain_lightning(schedule, microbatches, accumulate):
    n_layer = 3
    reference = run_on_ranks(_fit, 1, n_layer, None, accumulate)[0]
    reference_logged, reference_returned, reference_params, _, reference_validated = reference
    kwargs = dict(pipeline_parallel_size=2, pipeline_schedule=schedule, pipeline_microbatches=microbatches)
    results = run_on_ranks(_fit, 2, n_layer, kwargs, accumulate, timeout=240)
    for logged, returned, _, _, validated in results:
        assert validated == pytest.approx(reference_validated, abs=1e-5)  # trainer.validate through the pipeline
        assert len(logged) == STEPS
        assert logged == pytest.approx(reference_logged, abs=1e-5)  # self.log saw the batch's loss on every rank
        assert returned == pytest.approx(reference_returned, abs=1e-5)  # what training_step returned, to callbacks
    # the module's parameters against plain Lightning's: each stage's, under the model's own names
    merged = {}
    for _, _, params, _, _ in results:
        merged.update(params)
    assert set(merged) == set(reference_params)
    error = max((merged[name] - reference_params[name]).abs().max().item() for name in merged)
    loss_error = max(abs(a - b) for a, b in zip(results[0][0], reference_logged, strict=True))
    print(f"{schedule} m={microbatches} accumulate={accumulate}: loss {loss_error:.2e} param {error:.2e}")
    assert error < 1e-5
    if accumulate == 1:
        assert results[0][3] == pytest.approx(results[1][3])  # one clipping norm on both stages
        assert results[0][3] > CLIP  # clipping was active to the last step: its norm counted every stage
