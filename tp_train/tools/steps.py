"""A language model's training step as the simulator and the benchmarks run it on a `ParallelTraining`: a random
batch of token ids, the forward, the next-token loss (over the vocabulary's shards when the logits stay split), and
the backward; through the pipeline's schedule under a pipeline (its batch real even on a simulated rank: it is read).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.fake_ranks import real_values
from tp_train.training.parallel_training import ParallelTraining


def language_model_step(
    batch: int, seq: int, vocab: int, generator: torch.Generator | None = None, autocast: torch.dtype | None = None
) -> Callable[[ParallelTraining], None]:
    """`step(training)`: one forward and backward of `batch` sequences of `seq` tokens drawn from `vocab`; the forward
    and loss under CPU/CUDA autocast to `autocast` where given (Lightning's mixed precision)."""

    def step(training: ParallelTraining) -> None:
        device = next(training.root.parameters()).device  # a GPU rank's; the simulator's fake ranks are on the CPU
        with real_values():
            tokens = torch.randint(0, vocab, (batch, seq + 1), generator=generator).to(device)
            ids, targets = tokens[:, :-1], tokens[:, 1:]
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            if training.pipeline is not None:
                training.pipeline.train_step(ids, targets)
                return
            output = training.module(ids)
            logits = getattr(output, "logits", output)  # a Hugging Face model's output holds them
            if training.loss_parallel:
                group = training.mesh.tensor_parallel.get_group()
                loss = vocab_parallel_cross_entropy(logits, targets, group=group, vocab_size=vocab)
            else:
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()

    return step
