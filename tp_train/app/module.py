"""`CausalLMModule`: next-token training of any model mapping token ids (B, T) to logits (B, T, vocab)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F

from tp_train.checkpoint.dcp import ADAPTER_CONFIG_KEY, HUGGING_FACE_CONFIG_KEY, TOKENIZER_KEY
from tp_train.lightning.strategy import TensorParallelStrategy
from tp_train.parallel.experts.load_balance import load_balancing_loss
from tp_train.plan.applying.adapters import adapter_config_dict
from tp_train.plan.probe_input import run_without_cache

OptimizerFactory = Callable[[Iterable], torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]


class CausalLMModule(L.LightningModule):
    """Trains `model` to predict each next token of (B, T + 1) blocks.

    Args:
        model: a factory building the model (e.g. Hydra `_partial_: true`). It is called in `configure_model`
            under `trainer.init_module(empty_init=True)`, so with `TensorParallelStrategy` the full model is never
            materialised: each rank allocates only its shards. A built `nn.Module` is accepted too.
        optimizer: a factory taking parameter groups (e.g. `functools.partial(torch.optim.AdamW, lr=3e-4)`).
            Weight decay applies to parameters with two or more dimensions (matrices, embeddings); biases and
            norm weights are exempt.
        scheduler: an optional factory `(optimizer, total_steps=...)` returning a per-step LR scheduler.
        adapters: a peft config (e.g. `peft.LoraConfig`): the model is wrapped with `peft.get_peft_model` as it is
            built, before sharding, and only the adapters train (`tp_train.plan.applying.adapters` shards them with
            their layers).
    """

    # Its steps pass the model's output to the strategy's loss and nothing else: the head and loss may run fused.
    head_feeds_only_loss = True

    def __init__(
        self,
        model: Callable[[], nn.Module] | nn.Module,
        optimizer: OptimizerFactory,
        scheduler: SchedulerFactory | None = None,
        adapters=None,
    ):
        super().__init__()
        self._model_factory = None if isinstance(model, nn.Module) else model
        self.model = model if isinstance(model, nn.Module) else None
        self._optimizer_factory = optimizer
        self._scheduler_factory = scheduler
        self.adapters = adapters
        if self.model is not None and adapters is not None:
            self.model = _with_adapters(self.model, adapters)

    def configure_model(self) -> None:
        if self.model is None:
            with self.trainer.init_module(empty_init=True):
                model = self._model_factory()
                self.model = model if self.adapters is None else _with_adapters(model, self.adapters)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self._model_output(idx)
        return getattr(out, "logits", out)  # Hugging Face models return a ModelOutput

    def _model_output(self, idx: torch.Tensor):
        """The model's own output for `idx` (a Hugging Face ModelOutput, with router logits where its config asks
        for them); training builds no generation cache (some families cannot)."""
        return run_without_cache(self.model, idx)

    def _loss(self, batch: torch.Tensor, train: bool = False) -> torch.Tensor:
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        out = self._model_output(inputs)
        logits = getattr(out, "logits", out)
        strategy = self.trainer.strategy
        if isinstance(strategy, TensorParallelStrategy):
            # Vocab-sharded logits under `loss_parallel` (the app's default): never gathered.
            loss = strategy.cross_entropy(logits, targets)
        else:
            logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # softmax in fp32
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        router_logits = getattr(out, "router_logits", None)
        if train and router_logits:  # a Hugging Face MoE with output_router_logits: its routers' balance trains
            return loss + self._load_balancing_loss(router_logits, inputs.numel())
        return loss

    def _load_balancing_loss(self, router_logits, tokens: int) -> torch.Tensor:
        """The model's auxiliary loss times its `router_aux_loss_coef`, over the global batch: the same at any
        dp, cp, tp and ep (`tp_train.parallel.experts.load_balance`). Routers that saw a shard of this rank's
        context-parallel share of `tokens` (sequence parallelism with the experts whole) have their rows summed over
        the tensor-parallel ranks too; routers that saw all of it (the experts split by the plan) routed alike
        there."""
        strategy, config = self.trainer.strategy, self.model.config
        sequence_group = None
        if isinstance(strategy, TensorParallelStrategy):
            group = strategy.replica_group
            rows = router_logits[0].numel() // router_logits[0].shape[-1]  # routed here; cp's share of `tokens`
            if rows * strategy.context_parallel_size < tokens:
                sequence_group = strategy.tensor_parallel_group
        else:
            group = torch.distributed.group.WORLD if torch.distributed.is_initialized() else None
        experts = router_logits[0].shape[-1]
        aux, loads = load_balancing_loss(router_logits, experts, config.num_experts_per_tok, group, sequence_group)
        self.log("train/aux_loss", aux.detach())
        for layer, load in enumerate(loads):  # max over mean of each layer's tokens per expert: 1 when balanced
            self.log(f"train/moe/imbalance_{layer}", load.max() / load.mean().clamp(min=1e-9))
        return config.router_aux_loss_coef * aux

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch, train=True)
        self.log("train/loss", self._batch_loss(loss), prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        # The same batch's loss on every rank; over the epoch, Lightning's mean over the batches and ranks
        self.log("val/loss", self._batch_loss(loss), prog_bar=True, sync_dist=True)
        return loss

    def _batch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What is logged of `loss` (this rank's): the whole batch's, as one process would compute it on it, at any
        layout (`TensorParallelStrategy.batch_loss`); the gradients come from `loss` itself."""
        strategy = self.trainer.strategy
        return strategy.batch_loss(loss) if isinstance(strategy, TensorParallelStrategy) else loss

    def on_validation_epoch_end(self) -> None:
        loss = self.trainer.callback_metrics.get("val/loss")
        if loss is not None:
            # From the already averaged val/loss, the same on every rank; capped: exp overflows for a diverged model.
            self.log("val/ppl", math.exp(min(loss.item(), 50.0)), sync_dist=True)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        config = getattr(self.model, "config", None)
        if hasattr(config, "to_dict"):  # a Hugging Face model: what `tp_train.tools.export` rebuilds it from
            checkpoint[HUGGING_FACE_CONFIG_KEY] = config.to_dict()
        if self.adapters is not None:  # what export merges or writes as a peft adapter directory
            checkpoint[ADAPTER_CONFIG_KEY] = adapter_config_dict(self.adapters)
        datamodule = getattr(self.trainer, "datamodule", None)
        if getattr(datamodule, "tokenizer_source", None):  # what generation decodes with
            checkpoint[TOKENIZER_KEY] = datamodule.tokenizer_source

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = self._optimizer_factory([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
        if self._scheduler_factory is None:
            return optimizer
        total_steps = int(self.trainer.estimated_stepping_batches)
        scheduler = self._scheduler_factory(optimizer, total_steps=total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _with_adapters(model: nn.Module, adapters) -> nn.Module:
    from peft import get_peft_model

    return get_peft_model(model, adapters)
