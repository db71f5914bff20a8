"""`save_distributed_checkpoint=False`: a LightningModule written as Lightning's docs write one, trained at tp=2,
saves one consolidated file that `Module.load_from_checkpoint` reads in a plain process with the tp=2 model's
validation loss, and that `fit(ckpt_path="last")` resumes at tp=2 exactly (and at tp=1)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests import train_cases
from tests.distributed import run_on_ranks
from tests.lightning_helpers import GLOBAL_BATCH, LitLM, StepRecorder, fit, loader, make_trainer, token_data, validate
from tests.parity import next_token_loss
from tp_train import TensorParallelStrategy

EPOCH = 3  # batches per epoch: the save at step 3 ends one


class DocLM(LitLM):
    """As Lightning's docs write a LightningModule: its hyperparameters saved, its model built in `__init__`."""

    def __init__(self, lr: float = 1e-2):
        super().__init__(lr=lr)
        self.save_hyperparameters()


def _fit(rank, world_size, directory, steps, ckpt_path=None):
    torch.manual_seed(0)
    recorder = StepRecorder()
    checkpoint = ModelCheckpoint(dirpath=directory, monitor="val_loss", save_top_k=1, save_last=True)
    trainer = make_trainer(
        world_size, [recorder, checkpoint], strategy_kwargs={"save_distributed_checkpoint": False},
        max_steps=steps, enable_checkpointing=True, val_check_interval=EPOCH, check_val_every_n_epoch=None,
    )  # fmt: skip
    train, val = loader(world_size, EPOCH), loader(world_size, 2, seed=99)
    trainer.fit(DocLM(), train, val, ckpt_path=ckpt_path)
    return recorder.losses, checkpoint.best_model_path, float(checkpoint.best_model_score)


def _val_loss_at(rank, world_size, path):
    torch.manual_seed(123)  # another init: everything must come from the checkpoint
    trainer = make_trainer(world_size)
    (metrics,) = trainer.validate(DocLM(), loader(world_size, 2, seed=99), ckpt_path=path, verbose=False)
    return metrics["val_loss"]


@pytest.mark.slow
def test_a_consolidated_file_loads_in_one_process_and_resumes_at_tp2(tmp_path):
    straight, _, _ = run_on_ranks(_fit, 2, str(tmp_path / "straight"), 2 * EPOCH, timeout=300)[0]
    first, best, best_score = run_on_ranks(_fit, 2, str(tmp_path / "run"), EPOCH, timeout=300)[0]
    assert best.endswith(".ckpt") and (tmp_path / "run" / "last.ckpt").is_file()  # files, not directories

    plain = DocLM.load_from_checkpoint(best)  # one plain process: no ranks, no strategy
    data = token_data(2, seed=99).tensors[0]
    with torch.no_grad():
        plain_val = sum(next_token_loss(plain.model(b), b).item() for b in data.split(GLOBAL_BATCH)) / 2
    print(f"val loss: tp=2 {best_score}, load_from_checkpoint in one process {plain_val}")
    assert plain_val == pytest.approx(best_score, abs=1e-5)
    assert run_on_ranks(_val_loss_at, 1, best, timeout=300)[0] == pytest.approx(best_score, abs=1e-5)  # at tp=1

    second, _, _ = run_on_ranks(_fit, 2, str(tmp_path / "run"), 2 * EPOCH, "last", timeout=300)[0]
    print({"straight": straight, "resumed": first + second})
    assert len(first) == len(second) == EPOCH
    assert first + second == pytest.approx(straight, abs=1e-5)


def _fit_sharded(rank, world_size, path):
    fit(world_size, EPOCH, save_to=path)  # the default: a directory of shards
    return validate(world_size, path)


@pytest.mark.slow
def test_a_sharded_checkpoint_exported_with_tp_train_export_lightning_loads_in_one_process(tmp_path):
    sharded, exported = tmp_path / "sharded.ckpt", tmp_path / "exported.ckpt"
    val_tp2 = run_on_ranks(_fit_sharded, 2, str(sharded), timeout=300)[0]
    assert sharded.is_dir()
    result = train_cases.run_module("tp_train.tools.export", ["--lightning", str(sharded), str(exported)], timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    plain = DocLM.load_from_checkpoint(exported)
    data = token_data(3, seed=99).tensors[0]
    with torch.no_grad():
        plain_val = sum(next_token_loss(plain.model(b), b).item() for b in data.split(GLOBAL_BATCH)) / 3
    print(f"val loss: tp=2 sharded {val_tp2}, exported file in one process {plain_val}")
    assert plain_val == pytest.approx(val_tp2, abs=1e-5)


def test_fsdp_and_pipeline_are_refused_in_one_line():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False gathers whole tensor-parallel shards"):
        TensorParallelStrategy(tensor_parallel_size=2, data_parallel="fsdp", save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match="rank 0, which holds only the first of pipeline_parallel_size=2 stages"):
        TensorParallelStrategy(pipeline_parallel_size=2, save_distributed_checkpoint=False)
