"""`TrainingMetrics`: throughput and memory, logged the way a tensor-parallel run needs them counted."""

from __future__ import annotations

import resource
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import Throughput, get_available_flops, measure_flops
from lightning.pytorch.utilities import rank_zero_warn

from tp_train.lightning.best_effort import BestEffort
from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.sharding import local_part
from tp_train.plan.parallelize import attached
from tp_train.training.memory import current_memory, measurable, peak_memory, reset_peak_memory
from tp_train.training.parallel_training import count_parameters

MIB = 2**20


def parallel_dims(trainer: L.Trainer) -> ParallelDims:
    """The strategy's degrees (`TensorParallelStrategy.parallel_dims`); under another strategy every rank takes its
    own batches (data parallelism only)."""
    dims = getattr(trainer.strategy, "parallel_dims", None)
    return dims if isinstance(dims, ParallelDims) else ParallelDims.from_world(trainer.world_size)


def peak_memory_mib(device: torch.device) -> float:
    """CUDA's peak allocated memory on a GPU; the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / MIB
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / MIB if sys.platform == "darwin" else peak / 1024


def _compute_dtype(trainer: L.Trainer) -> torch.dtype:
    precision = str(trainer.precision)
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("16") else torch.float32


class TrainingMetrics(L.Callback):
    """Logs `throughput/{tokens,samples,flops}_per_sec`, `throughput/mfu` (where the device's peak is known),
    `memory/peak_mib`, `memory/params_mib`, `train/grad_norm` (when clipping by norm) and `comm/tp_bytes_per_step`
    (what the tensor-parallel collectives of the step moved, from each sharded model's `tp_comm_counter`).

    A metric never ends a run: counting FLOPs, probing memory or logging the run's sizes that raises is skipped
    from then on with one warning (`BestEffort`); FLOPs that cannot be counted leave MFU and FLOPs/s unlogged.

    Args:
        window_size: batches in the moving window the rates are averaged over.
        loss_metric: the logged metric holding the batch's loss (`CausalLMModule`'s `train/loss`: the whole batch's
            at any layout), which `first_loss` keeps; where the module logs none, the first step's returned loss.
    """

    def __init__(self, window_size: int = 10, loss_metric: str = "train/loss"):
        self.window_size = window_size
        self.loss_metric = loss_metric
        self.flops_per_batch: int | None = None  # fwd + bwd of the unsharded model, per local batch
        self.tokens_per_sec: float | None = None
        self.first_loss: float | None = None
        self._throughput: Throughput | None = None
        # of the whole model (every pipeline stage, unsharded), counted as training starts
        self.parameters = self.trainable_parameters = None
        self.parameters_on_rank: int | None = None  # what this rank holds: its stages' shards
        # the most memory set-up took above what the rank held before it (building, sharding, cutting the model)
        self.setup_peak_mib: float | None = None
        self._before_setup: int | None = None
        self._counted_step: int | None = None  # the optimizer step the communication counters count
        self._optional = BestEffort(type(self).__name__)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        if stage == "fit" and measurable(device):  # before configure_model builds the model
            reset_peak_memory(device)
            self._before_setup = current_memory(device)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._before_setup is not None:  # the strategy's setup is done: the model as it trains, no step taken
            peak = peak_memory(trainer.strategy.root_device) - self._before_setup
            self.setup_peak_mib = max(peak, 0) / MIB

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        device = trainer.strategy.root_device
        self._throughput = Throughput(
            available_flops=get_available_flops(device, _compute_dtype(trainer)),
            world_size=trainer.world_size,
            window_size=self.window_size,
        )
        self._start = time.perf_counter()
        self._paused = 0.0  # time spent in validation, which is not training throughput
        self._samples = self._tokens = self._batches = 0
        params = sum(local_part(p).numel() * p.element_size() for p in pl_module.parameters())  # FSDP2: this rank's
        # The largest rank's (ranks of a tensor-parallel group hold different shards): a reduction, so every rank
        # logs it; not through BestEffort, since a rank that skipped it would leave its peers in the collective.
        pl_module.log("memory/params_mib", params / MIB, reduce_fx="max", sync_dist=True)
        # the whole model's, every pipeline stage's: the strategy's parallelized model (TensorParallelStrategy's), or
        # this module as it is
        training = getattr(trainer.strategy, "parallel_training", None)
        device = trainer.strategy.root_device
        counts = training.parameter_counts(device) if training is not None else count_parameters(pl_module)
        self.parameters, self.trainable_parameters = counts
        self.parameters_on_rank = sum(local_part(p).numel() for p in pl_module.parameters())
        if trainer.logger:
            self._optional(
                "logging the run's sizes",
                lambda: trainer.logger.log_hyperparams(self._sizes(trainer, pl_module)),
                "they are not in the logger's hyperparameters",
            )

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        if trainer.global_step != self._counted_step:  # an optimizer step's micro-batches add up; nothing else does
            self._counted_step = trainer.global_step
            for counter in attached(pl_module, "tp_comm_counter"):
                counter.reset()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()  # time what ran, not what was queued
        if self.first_loss is None:
            logged = trainer.callback_metrics.get(self.loss_metric)
            returned = outputs.get("loss") if isinstance(outputs, dict) else None
            first = logged if logged is not None else returned
            self.first_loss = first.item() if first is not None else None
        batch_size, block = batch.shape[0], batch.shape[1] - 1
        if self.flops_per_batch is None:  # 0 once they cannot be counted: not tried again
            counted = None
            if trainer.is_global_zero:  # the unsharded model's count, the same on every rank: counted once
                counted = self._optional(
                    "counting FLOPs", lambda: self._measure_flops(pl_module, batch_size, block),
                    "FLOPs/s and MFU are not logged", default=0, every_rank=True,
                )  # fmt: skip
            self.flops_per_batch = trainer.strategy.broadcast(counted, src=0)
        self._batches += 1
        self._samples += batch_size
        self._tokens += batch_size * block
        dims = parallel_dims(trainer)
        self._throughput.update(
            time=time.perf_counter() - self._start - self._paused,
            batches=self._batches,
            samples=self._samples,
            lengths=self._tokens,
            # this device's share: a data-parallel rank's batch is split over tp x cp x pp ranks
            flops=self.flops_per_batch // dims.model_parallel if self.flops_per_batch else None,
        )
        metrics = self._throughput.compute()
        data_parallel = dims.dp  # ranks taking different batches
        logged: dict[str, Any] = {}
        peak = self._optional("probing peak memory", lambda: peak_memory_mib(trainer.strategy.root_device),
                              "memory/peak_mib is not logged")  # fmt: skip
        if peak is not None:
            logged["memory/peak_mib"] = peak
        if "device/items_per_sec" in metrics:
            self.tokens_per_sec = metrics["device/items_per_sec"] * data_parallel
            logged["throughput/tokens_per_sec"] = self.tokens_per_sec
            logged["throughput/samples_per_sec"] = metrics["device/samples_per_sec"] * data_parallel
        for key, name in (("flops_per_sec", "throughput/flops_per_sec"), ("device/mfu", "throughput/mfu")):
            if key in metrics:
                logged[name] = metrics[key]
        counters = attached(pl_module, "tp_comm_counter")
        if counters:
            logged["comm/tp_bytes_per_step"] = float(sum(counter.bytes for counter in counters))
        grad_norm = getattr(trainer.strategy.precision_plugin, "last_grad_norm", None)
        if grad_norm is not None:
            logged["train/grad_norm"] = grad_norm.item()
        for name, value in logged.items():
            pl_module.log(name, value, prog_bar=name == "throughput/tokens_per_sec", rank_zero_only=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._validation_start = time.perf_counter()

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._throughput is not None:  # validation inside fit
            self._paused += time.perf_counter() - self._validation_start

    def _measure_flops(self, pl_module: L.LightningModule, batch_size: int, block: int) -> int | None:
        """FLOPs of one forward and backward of the unsharded model, counted on a meta-device copy: in bf16 where its
        own dtype cannot run there (Hugging Face's grouped-GEMM experts, `torch._grouped_mm`, refuse fp32 on meta);
        a matmul's FLOPs are the same in any dtype."""
        factory = getattr(pl_module, "_model_factory", None)
        if factory is None:
            rank_zero_warn("TrainingMetrics: no model factory on the module; FLOPs and MFU are not logged")
            return 0
        with torch.device("meta"):
            model = factory()
            idx = torch.zeros(batch_size, block, dtype=torch.long)

        def forward():
            out = model(idx)
            return getattr(out, "logits", out)

        try:
            return int(measure_flops(model, forward, lambda logits: logits.sum()))
        except RuntimeError:
            model.to(torch.bfloat16)
            return int(measure_flops(model, forward, lambda logits: logits.sum()))

    def _sizes(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        dims = parallel_dims(trainer)
        return {
            "tp": dims.tp,
            "dp": dims.dp,
            "precision": str(trainer.precision),
            "parameters": self.parameters,
            "trainable_parameters": self.trainable_parameters,
            "parameters_on_rank": self.parameters_on_rank,
            "data_parallel": getattr(getattr(trainer.strategy, "options", None), "data_parallel", "ddp"),
        }
