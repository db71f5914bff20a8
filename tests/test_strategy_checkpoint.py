"""TensorParallelStrategy checkpoints: sharded saves that resume exactly and reshard across dp x tp, and a
consolidated export that loads into the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

import tp_train
from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit, token_data, validate
from tests.parity import next_token_loss
from tests.test_parallelize import SwiGLUModel

# Epochs of 10 batches: the checkpoint after step 10 ends an epoch. (Resuming mid-epoch exactly needs a resumable
# DataLoader, which Lightning asks of the data, not of the strategy: see TextDataModule and its tests.)
EPOCH = 10


def _straight(rank, world_size):
    return fit(2, 20, data_steps=EPOCH)[1].losses


def _interrupted(rank, world_size, directory):
    # Saved by ModelCheckpoint during training, as real runs are, then resumed by a fresh module and trainer.
    every_10 = ModelCheckpoint(dirpath=directory, every_n_train_steps=10, save_top_k=-1, filename="{step}")
    first = fit(2, 10, data_steps=EPOCH, callbacks=[every_10], enable_checkpointing=True)[1].losses
    second = fit(2, 20, data_steps=EPOCH, ckpt_path=f"{directory}/step=10.ckpt")[1].losses
    return first, second


def test_resume_gives_the_same_losses_as_training_straight_through(tmp_path):
    straight = run_on_ranks(_straight, 2, timeout=300)[0]
    first, second = run_on_ranks(_interrupted, 2, str(tmp_path), timeout=300)[0]
    assert len(straight) == 20 and len(first) == 10 and len(second) == 10
    assert first + second == pytest.approx(straight, abs=1e-5)


def _train_save_and_export(rank, world_size, path):
    trainer, _ = fit(2, 6, save_to=path)
    module = trainer.lightning_module
    full = tp_train.full_state_dict(module.model, trainer.strategy.tensor_parallel_group)
    idx = token_data(1, seed=5).tensors[0]
    sharded_loss = next_token_loss(module.model(idx), idx).item()
    plain = SwiGLUModel()
    plain.load_state_dict(full, strict=True)
    return sharded_loss, next_token_loss(plain(idx), idx).item(), validate(2, path)


def _validate(rank, world_size, tp, path):
    return validate(tp, path)


def test_checkpoint_saved_at_tp2_validates_the_same_at_tp1_tp4_and_exports(tmp_path):
    path = str(tmp_path / "tp2.ckpt")
    sharded_loss, plain_loss, val_tp2 = run_on_ranks(_train_save_and_export, 2, path, timeout=300)[0]
    assert plain_loss == pytest.approx(sharded_loss, abs=1e-5)  # the export loads into the plain model
    val_tp1 = run_on_ranks(_validate, 1, 1, path, timeout=300)[0]
    val_tp4 = run_on_ranks(_validate, 4, 4, path, timeout=300)[0]
    val_dp2_tp2 = run_on_ranks(_validate, 4, 2, path, timeout=300)[0]
    assert val_tp1 == pytest.approx(val_tp2, abs=1e-5)
    assert val_tp4 == pytest.approx(val_tp2, abs=1e-5)
    assert val_dp2_tp2 == pytest.approx(val_tp2, abs=1e-5)
    # The checkpoint really changed the model: a fresh init validates differently.
    assert abs(val_tp2 - _fresh_val_loss()) > 1e-2


def _fresh_val_loss() -> float:
    torch.manual_seed(123)
    model = SwiGLUModel()
    idx = token_data(3, seed=99).tensors[0]
    with torch.no_grad():
        return next_token_loss(model(idx), idx).item()


_ = dist  # the ranks' process group is set up by run_on_ranks
