"""`TensorParallelStrategy`'s cross-entropy: over whole logits, over vocabulary-sharded ones, or fused with the
vocabulary-parallel head, compiled with `torch.compile` when the model is, over every context-parallel rank's tokens;
and the batch's loss for logging, from each data x context parallel rank's own."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed import ProcessGroup

from tp_train.errors import HeadOutputChangedError
from tp_train.parallel.context_parallel.models import context_parallel_cross_entropy
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from tp_train.parallel.invariant import FAST
from tp_train.plan.parallelize import attached

# What a LightningModule sets to say that its training and validation steps pass the model's output to
# `strategy.cross_entropy` and nothing else (`CausalLMModule` does): the head and the loss may then run fused.
HEAD_FEEDS_ONLY_LOSS = "head_feeds_only_loss"


def _whole_logits_loss(logits, target, ignore_index, label_smoothing):
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits  # the softmax in fp32
    return F.cross_entropy(
        logits.flatten(0, -2), target.flatten(), ignore_index=ignore_index, label_smoothing=label_smoothing
    )


def _compiled(fn, compile: bool | str):
    """`fn` through torch.compile when `compile` is True or a backend's name (tests skip code generation with
    "aot_eager"); else `fn`."""
    if not compile:
        return fn
    return torch.compile(fn, backend=compile if isinstance(compile, str) else "inductor")


class StrategyLoss:
    """Mean cross-entropy of a model's output against targets, whichever way its head was sharded.

    Args:
        fused: compute the head and the loss together (`vocab_parallel_linear_cross_entropy`), so the logits never
            exist: True, False, or None for "when the LightningModule says its head feeds only the loss"
            (`HEAD_FEEDS_ONLY_LOSS`). With `loss_parallel` and a head without bias only.
        compile: run the loss through `torch.compile`, as the model (True, or a backend's name).
        context_parallel: the logits are of this rank's share of each sequence; `cross_entropy` is the mean over all
            of its tokens.
        loss_parallel: the head's logits are sharded along the vocabulary (`vocab_parallel_cross_entropy`, writing
            their gradient into their own buffer: nothing else reads them). The strategy sets it once the model is
            sharded, from what sharding decided (`ParallelTraining.loss_parallel`).
        numerics: the vocabulary-parallel loss's ("invariant": its sums in one fixed order; never fused).
    """

    def __init__(
        self,
        fused: bool | None,
        compile: bool | str,
        context_parallel: bool = False,
        loss_parallel: bool = False,
        numerics: str = FAST,
    ) -> None:
        self.loss_parallel = loss_parallel
        self.numerics = numerics
        self.fused = fused
        self.context_parallel = context_parallel
        self._vocab_size: int | None = None  # of the head `loss_parallel` keeps sharded, read once sharded
        self.targets: torch.Tensor | None = None  # counted by `count` in this training or validation step
        self._head_fusions: list | None = None
        self._sharded = _compiled(self._sharded_loss, compile)
        self._whole = _compiled(_whole_logits_loss, compile)
        self._fused = _compiled(vocab_parallel_linear_cross_entropy, compile)

    @contextmanager
    def fusing(self, root: nn.Module):
        """Within: the vocabulary-parallel heads of `root` hand their input to the loss, if the head and loss fuse."""
        fuse = self.fused if self.fused is not None else getattr(root, HEAD_FEEDS_ONLY_LOSS, False)
        with ExitStack() as stack:
            if self.loss_parallel and fuse:
                for fusion in self._fusions(root):
                    stack.enter_context(fusion.deferring())
            yield

    def step(self, root: nn.Module, step: Callable[[], object]):
        """`step()` (a training or validation step) within `fusing(root)`. A model that transforms its head's output
        before the loss (Gemma-3n's and Cohere-2's final logit soft-cap or scale: the head's logits must exist) is
        refused by the fused loss; when fusing was only the default (`fused=None`), the step runs again unfused and
        fusion stays off for the run, with one info line. The first forward's graph is dropped before any backward.
        """
        self.targets = None
        try:
            with self.fusing(root):
                return step()
        except HeadOutputChangedError as error:
            if self.fused is not None:  # asked for by the user: refused
                raise
            self.fused = False
            rank_zero_info(f"fused_loss off: {error.args[0].split('; ')[0]}; the head's logits are computed")
            self.targets = None
            return step()

    def count(self, target: torch.Tensor, ignore_index: int) -> None:
        """Adds `target`'s targets not ignored to the step's `targets` (on the device: no sync)."""
        counted = (target != ignore_index).sum()
        self.targets = counted if self.targets is None else self.targets + counted

    def cross_entropy(self, root: nn.Module, group: ProcessGroup | None, logits, target, ignore_index, label_smoothing):
        """The step's loss (the call below), its targets counted (`count`): with `context_parallel`, the mean over
        the whole sequence's tokens (`context_parallel_cross_entropy`, which finds their group in `root`)."""
        self.count(target, ignore_index)  # what the batch's loss weighs this rank's mean by
        loss = partial(self, root, group)
        if self.context_parallel:
            return context_parallel_cross_entropy(loss, logits, target, root, ignore_index, label_smoothing)
        return loss(logits, target, ignore_index, label_smoothing)

    def _fusions(self, root: nn.Module) -> list:
        """The `HeadLossFusion`s `parallelize` set on the heads inside `root`, looked up once (sharded once)."""
        if self._head_fusions is None:
            self._head_fusions = attached(root, "tp_loss_fusion")
        return self._head_fusions

    def __call__(self, root: nn.Module, group: ProcessGroup, logits, target, ignore_index, label_smoothing):
        if not self.loss_parallel:
            return self._whole(logits, target, ignore_index, label_smoothing)
        if self._vocab_size is None:
            sizes = set(attached(root, "tp_vocab_size"))
            if len(sizes) != 1:
                raise RuntimeError(f"loss_parallel: expected one sharded LM head, found vocabulary sizes {sizes}")
            (self._vocab_size,) = sizes
        for fusion in self._fusions(root):
            held = fusion.take(logits)
            if held is not None:  # `logits` are the head's input: the head runs here, chunk by chunk
                hidden, head = held
                return self._fused(hidden, head.weight, target, group, self._vocab_size, ignore_index, label_smoothing)
        return self._sharded(logits, target, group, ignore_index, label_smoothing)

    def _sharded_loss(self, logits, target, group, ignore_index, label_smoothing):
        return vocab_parallel_cross_entropy(
            logits, target, group, self._vocab_size, ignore_index, label_smoothing, in_place_backward=True,
            numerics=self.numerics,
        )  # fmt: skip
