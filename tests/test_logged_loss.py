"""The logged loss is the whole batch's at every layout: through Lightning on 4 gloo ranks, at dp=4, pp=2 x dp=2 and
cp=2 x dp=2, with targets ignored unevenly across the data-parallel replicas, the training and validation losses
logged with `strategy.batch_loss` are one process's token mean over the whole batch on every rank, not a mean of the
replicas' means. (The gradients are DDP's average of the replicas' means: the optimizer's lr is 0, so that every
step's loss is the initial model's.) Through `train.py`: tests/test_expert_parallel_train.py, dp=2 against one
device; the parameters counted at pp=2: tests/test_pipeline_train.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tests.test_pipeline import batches, tiny_gpt
from tests.test_pipeline_lightning import LoggedLoss, PlainLM

STEPS = 2
# name -> strategy arguments, on 4 ranks: the rest of them are data-parallel replicas (the mesh is (pp, dp, cp, tp))
LAYOUTS = {
    "dp4": dict(),
    "pp2_dp2": dict(pipeline_parallel_size=2, pipeline_microbatches=2),
    "cp2_dp2": dict(context_parallel_size=2),
}


class BatchLossLM(PlainLM):
    """Logs the batch's loss as `CausalLMModule` does (`strategy.batch_loss` of the step's own); trains at lr 0."""

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", self.trainer.strategy.batch_loss(loss))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("val_loss", self.trainer.strategy.batch_loss(loss), sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _logged(rank, world_size):
    import lightning.pytorch as L
    from torch.utils.data import DataLoader, TensorDataset

    from tp_train import TensorParallelStrategy

    torch.set_num_threads(1)
    ids, targets = (torch.cat(parts) for parts in zip(*batches(STEPS), strict=True))
    batch = ids.shape[0] // STEPS
    out = {}
    for name, kwargs in LAYOUTS.items():
        cp = kwargs.get("context_parallel_size", 1)
        replicas = world_size // (kwargs.get("pipeline_parallel_size", 1) * cp)
        share, replica = batch // replicas, rank // cp % replicas
        rows = [step * batch + replica * share + k for step in range(STEPS) for k in range(share)]
        data = DataLoader(TensorDataset(ids[rows], targets[rows]), batch_size=share)
        module, recorder = BatchLossLM(2), LoggedLoss()
        trainer = L.Trainer(
            strategy=TensorParallelStrategy(**kwargs), accelerator="cpu", devices=world_size, max_steps=STEPS,
            callbacks=[recorder], logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, use_distributed_sampler=False,
        )  # fmt: skip
        trainer.fit(module, data)
        (validated,) = trainer.validate(module, data, verbose=False)
        out[name] = (recorder.logged, validated["val_loss"])
    return out


def _one_process() -> tuple[list[float], float, list[float]]:
    """At the initial weights: each step's token mean over its whole batch, the validation epoch's (every step's
    batch, weighted by its size as Lightning weighs them), and each step's mean of its two halves' means (what two
    replicas' own means average to)."""
    model = tiny_gpt(2)
    whole, halves = [], []
    with torch.no_grad():
        for ids, targets in batches(STEPS):
            logits = model(ids)
            whole.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())
            means = [F.cross_entropy(logits[k : k + 2].flatten(0, 1), targets[k : k + 2].flatten()) for k in (0, 2)]
            halves.append(sum(means).item() / 2)
    return whole, sum(whole) / STEPS, halves


@pytest.mark.slow
def test_the_logged_loss_is_the_whole_batch_token_mean_at_dp_pp_x_dp_and_cp_x_dp():
    whole, validation, mean_of_halves = _one_process()
    assert min(abs(a - b) for a, b in zip(whole, mean_of_halves, strict=True)) > 1e-3  # the padding tells them apart
    results = run_on_ranks(_logged, 4, timeout=240)
    for name in LAYOUTS:
        for rank, (logged, validated) in enumerate(result[name] for result in results):
            assert logged == pytest.approx(whole, abs=1e-5), (name, rank, logged, whole)
            assert validated == pytest.approx(validation, abs=1e-5), (name, rank, validated, validation)
