"""A LightningModule around a model written in the tests (only a `tp_plan` tells tp_train how to shard it), and a
Trainer runner that records what every step did. Used inside ranks started by `run_on_ranks`, which sets
LOCAL_RANK / RANK / WORLD_SIZE as torchrun would, so Lightning joins the existing process group."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.parity import next_token_loss
from tests.test_parallelize import VOCAB, SwiGLUModel
from tp_train import TensorParallelStrategy
from tp_train.parallel.sharding import local_part
from tp_train.plan.meta_init import deferred_init, materialize_remaining

SEQ_LEN = 16
GLOBAL_BATCH = 4


class LitLM(L.LightningModule):
    def __init__(
        self, lr: float = 1e-2, build_in_configure_model: bool = False, build: Callable[[], Any] = SwiGLUModel
    ):
        super().__init__()
        self.lr = lr
        self.build = build
        self.build_in_configure_model = build_in_configure_model
        self.model = None if build_in_configure_model else build()

    def configure_model(self):
        if self.model is None:
            with self.trainer.init_module(empty_init=True):
                self.model = self.build()

    def training_step(self, batch, batch_idx):
        (idx,) = batch
        return next_token_loss(self.model(idx), idx)

    def validation_step(self, batch, batch_idx):
        (idx,) = batch
        loss = next_token_loss(self.model(idx), idx)
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def token_data(steps: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ_LEN), generator=generator))


def _checksum(module: torch.nn.Module) -> float:
    """A sum over this rank's parameter elements (its pieces, under FSDP2)."""
    return sum(local_part(p).detach().double().sum().item() for p in module.parameters())


class StepRecorder(L.Callback):
    """Per step: the loss averaged over all ranks (the global batch's loss), the global gradient norm the strategy
    clipped by, and a plain norm of this rank's gradients before clipping."""

    def __init__(self):
        self.losses, self.clip_norms, self.local_norms, self.scales, self.skipped = [], [], [], [], []
        self._checksum = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._checksum = _checksum(pl_module)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        grads = [local_part(p.grad) for p in pl_module.parameters() if p.grad is not None]
        self.local_norms.append(torch.nn.utils.get_total_norm(grads).item())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float().clone()
        dist.all_reduce(loss)
        self.losses.append(loss.item() / dist.get_world_size())
        norm = getattr(trainer.strategy.precision_plugin, "last_grad_norm", None)  # None in plain Lightning
        self.clip_norms.append(None if norm is None else norm.item())
        scaler = getattr(trainer.strategy.precision_plugin, "scaler", None)
        self.scales.append(None if scaler is None else scaler.get_scale())
        self.skipped.append(self._checksum == _checksum(pl_module))


def make_trainer(
    tensor_parallel_size: int | None,
    callbacks: list | None = None,
    data_parallel: str = "ddp",
    strategy_kwargs: dict | None = None,
    **trainer_kwargs: Any,
) -> L.Trainer:
    """A Trainer on every rank with TensorParallelStrategy; with `tensor_parallel_size=None`, plain Lightning on
    one device (strategy="auto"), the reference the strategy is compared with."""
    plain = tensor_parallel_size is None
    defaults = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return L.Trainer(
        strategy="auto"
        if plain
        else TensorParallelStrategy(
            tensor_parallel_size=tensor_parallel_size, data_parallel=data_parallel, **(strategy_kwargs or {})
        ),
        accelerator="cpu",
        devices=1 if plain else dist.get_world_size(),
        callbacks=callbacks,
        **{**defaults, **trainer_kwargs},
    )


def loader(tensor_parallel_size: int | None, steps: int, seed: int = 0, micro_batches: int = 1) -> DataLoader:
    """`steps` global batches, split over the data-parallel ranks, each in `micro_batches` micro-batches (plain
    Lightning, `tensor_parallel_size=None`: one device, whole batches)."""
    if tensor_parallel_size is None:
        # The order Lightning's distributed sampler (shuffled, seed 0) gives the strategy's runs: each of their
        # global batches is one of these whole batches.
        data = token_data(steps, seed)
        return DataLoader(data, batch_size=GLOBAL_BATCH, sampler=DistributedSampler(data, num_replicas=1, rank=0))
    dp = dist.get_world_size() // tensor_parallel_size
    return DataLoader(token_data(steps, seed), batch_size=GLOBAL_BATCH // dp // micro_batches)


def fit(
    tensor_parallel_size: int | None,
    steps: int,
    module_kwargs: dict | None = None,
    callbacks: list | None = None,
    data_steps: int | None = None,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    **trainer_kwargs: Any,
) -> tuple[L.Trainer, StepRecorder]:
    """Trains a LitLM(**module_kwargs), built after seeding 0, for `steps` steps on `data_steps` batches (default:
    as many as steps), optionally resuming from `ckpt_path` and saving to `save_to`."""
    torch.manual_seed(0)
    module = LitLM(**(module_kwargs or {}))
    recorder = StepRecorder()
    trainer = make_trainer(tensor_parallel_size, [recorder, *(callbacks or [])], max_steps=steps, **trainer_kwargs)
    micro_batches = trainer_kwargs.get("accumulate_grad_batches", 1)
    data = loader(tensor_parallel_size, data_steps or steps, micro_batches=micro_batches)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    if save_to:
        trainer.save_checkpoint(save_to)
    return trainer, recorder


def validate(tensor_parallel_size: int, ckpt_path: str, data_parallel: str = "ddp") -> float:
    """The validation loss of the checkpoint at `ckpt_path`, on a fixed held-out set, at this dp x tp."""
    torch.manual_seed(123)  # a different init: everything must come from the checkpoint
    trainer = make_trainer(tensor_parallel_size, data_parallel=data_parallel)
    (metrics,) = trainer.validate(LitLM(), loader(tensor_parallel_size, 3, seed=99), ckpt_path=ckpt_path, verbose=False)
    return metrics["val_loss"]


def meta_built(build: Callable[[], Any]) -> Callable[[], Any]:
    """`build` as tp_train builds a model on the meta device and gives it storage in one process: the initial
    weights a meta-built model starts from at every layout (each parameter drawn under its name's seed), for plain
    Lightning to train from. Picklable, to pass to ranks."""
    return partial(_built_on_meta, build)


def _built_on_meta(build: Callable[[], Any]) -> Any:
    with deferred_init():
        model = build()
    materialize_remaining(model, torch.device("cpu"))
    return model


def fit_plain(steps: int, **trainer_kwargs: Any) -> StepRecorder:
    """The reference: plain Lightning on one device (no tp_train), a LitLM built after seeding 0, `steps` steps of
    the global batch in the order the strategy's ranks see it."""
    return fit(None, steps, **trainer_kwargs)[1]
