"""`ValidationSamples`: text drawn from the model being trained at each validation, logged to W&B (`samples:` in
conf/train.yaml, off by default)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger

from tp_train.app.preflight import context_length
from tp_train.lightning.best_effort import BestEffort
from tp_train.tools.generation import Sampling, generate


class ValidationSamples(L.Callback):
    """After each validation (not the sanity check), continues each prompt with the model as it is now and logs the
    text: a W&B table `samples` (step, prompt, text) with a W&B logger, else one line per prompt on stdout. Writing
    the table that fails (W&B) is skipped with one warning; drawing the text is the model's computation, on every
    rank of its group, and is not.

    Args:
        prompts: the texts to continue; none: nothing is drawn.
        max_new_tokens: tokens to draw per prompt, at most.
        temperature: 0 for greedy decoding, else the sampling temperature.
        top_k: sample among the k most likely tokens only.
        seed: the sampling generator's seed, the same at every validation.
    """

    def __init__(
        self,
        prompts: Sequence[str] = (),
        max_new_tokens: int = 32,
        temperature: float = 0.0,
        top_k: int | None = None,
        seed: int = 0,
    ) -> None:
        self.prompts = list(prompts)
        self.max_new_tokens = max_new_tokens
        self.sampling = Sampling(temperature, top_k, seed)
        self._optional = BestEffort(type(self).__name__)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or not self.prompts:
            return
        tokenizer = trainer.datamodule.tokenizer
        group = getattr(trainer.strategy, "tensor_parallel_group", None)
        context = context_length(pl_module.model) or self.max_new_tokens * 2
        rows = []
        for prompt in self.prompts:
            ids = tokenizer.encode(prompt, add_special_tokens=False) or [tokenizer.eos_token_id]  # "": a new document
            ids = torch.tensor([ids[-(context - 1) :]], device=pl_module.device)  # room for one new token
            budget = min(self.max_new_tokens, context - ids.shape[1])
            new, _ = generate(pl_module.model, ids, budget, self.sampling, tokenizer.eos_token_id, group=group)
            rows.append([trainer.global_step, prompt, tokenizer.decode(new[0].tolist())])
        if trainer.is_global_zero:  # rank 0 alone writes: a failure there leaves no peer waiting
            self._optional("writing the samples table", lambda: _write(trainer, rows), "the samples are not logged")


def _write(trainer: L.Trainer, rows: list[list]) -> None:
    loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    for logger in loggers:
        logger.log_text(key="samples", columns=["step", "prompt", "text"], data=rows, step=trainer.global_step)
    if not loggers:
        for step, prompt, text in rows:
            print(f"sample at step {step}: {prompt!r} -> {text!r}", file=sys.stdout, flush=True)
