"""A user's own LightningModule, written for plain Lightning (F.cross_entropy, `self.log("val_loss")`, an AdamW with a
per-step schedule) with Lightning's own callbacks, `ModelCheckpoint(monitor="val_loss", save_top_k=2)`,
`EarlyStopping` and `LearningRateMonitor`, trains at pp=2 as it does under plain Lightning on one device: the same
values in its CSV log (losses, learning rates), early stopping at the same step, the same checkpoints kept (by name,
with the same scores) and the same best."""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

from tests.distributed import run_on_ranks
from tests.test_pipeline import SEQ, VOCAB, tiny_gpt
from tp_train import TensorParallelStrategy

STEPS, BATCH = 12, 4


class UserLM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = tiny_gpt(3)

    def _loss(self, batch):
        ids, targets = batch
        return F.cross_entropy(self.model(ids).flatten(0, 1), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._loss(batch))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def _data() -> tuple[DataLoader, DataLoader]:
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=generator)
    targets = (ids * 3 + 1) % VOCAB  # learnable: val_loss falls at every validation
    return DataLoader(TensorDataset(ids, targets), batch_size=BATCH), DataLoader(
        TensorDataset(ids[:8], targets[:8]), batch_size=BATCH
    )


def _fit(rank, world_size, directory: str):
    train, held_out = _data()
    checkpoint = ModelCheckpoint(dirpath=f"{directory}/checkpoints", monitor="val_loss", save_top_k=2)
    # no fall of val_loss counts (min_delta): patience 2 stops at the third validation (step 6), after the first two
    # checkpoints kept became the last two (the first removed)
    stopping = EarlyStopping(monitor="val_loss", min_delta=10.0, patience=2)
    plain = world_size == 1
    trainer = L.Trainer(
        strategy="auto" if plain else TensorParallelStrategy(pipeline_parallel_size=2, pipeline_microbatches=2),
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        callbacks=[checkpoint, stopping, LearningRateMonitor(logging_interval="step")],
        logger=CSVLogger(directory, name="logs", version=0),
        log_every_n_steps=1,
        val_check_interval=2,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the batches in order, on one device as on both stages
    )
    trainer.fit(UserLM(), train, held_out)
    kept = {Path(path).name: score.item() for path, score in checkpoint.best_k_models.items()}
    return trainer.global_step, kept, Path(checkpoint.best_model_path).name


def _logged(directory: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    with open(directory / "logs" / "version_0" / "metrics.csv") as file:
        for row in csv.DictReader(file):
            for name, value in row.items():
                if name not in ("step", "epoch") and value:
                    series.setdefault(name, {})[int(row["step"])] = float(value)
    return series


@pytest.mark.slow
def test_user_module_with_lightning_callbacks_at_pp2_as_on_one_device(tmp_path):
    plain, piped = tmp_path / "plain", tmp_path / "pp2"
    (steps, kept, best), *_ = run_on_ranks(_fit, 1, str(plain))
    results = run_on_ranks(_fit, 2, str(piped), timeout=240)
    assert steps == 6  # early stopping ended both runs, at the third validation
    for piped_steps, piped_kept, piped_best in results:
        assert piped_steps == steps
        assert sorted(piped_kept) == sorted(kept) and len(kept) == 2  # the same two best, the third removed
        assert [piped_kept[name] for name in sorted(kept)] == pytest.approx([kept[name] for name in sorted(kept)])
        assert piped_best == best
    assert sorted(path.name for path in (piped / "checkpoints").iterdir()) == sorted(kept)
    assert sorted(path.name for path in (plain / "checkpoints").iterdir()) == sorted(kept)
    reference, logged = _logged(plain), _logged(piped)
    assert set(logged) == set(reference) >= {"train_loss", "val_loss", "lr-AdamW"}
    for name, values in reference.items():
        assert logged[name].keys() == values.keys(), name
        assert list(logged[name].values()) == pytest.approx(list(values.values()), abs=1e-5), name
