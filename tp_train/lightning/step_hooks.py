"""The step hooks `TensorParallelStrategy` overrides (a mixin before DDPStrategy): each step through the step runner
chosen at setup (`tp_train.lightning.steps`), with Lightning's own hook as its default; the loss the user's steps
compute (`cross_entropy`) and log (`batch_loss`); and what training needs around backward, from the model as
`tp_train.training.parallelize_for_training` parallelized it (`ParallelTraining`)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from typing_extensions import override

from tp_train.lightning.loss import StrategyLoss
from tp_train.lightning.pipeline import PipelineSteps
from tp_train.lightning.steps import ModelSteps
from tp_train.training import ParallelTraining


class StepHooks:
    """Mixin for a Lightning strategy holding `_steps` (its step runner), `_loss` (`StrategyLoss`),
    `parallel_training` and `tensor_parallel_group`."""

    _steps: ModelSteps | PipelineSteps
    _loss: StrategyLoss
    parallel_training: ParallelTraining

    def cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """Mean cross-entropy of `logits` (..., vocab) against `target` (...), whichever way the model's head
        was sharded: with `loss_parallel` each rank holds its slice of the vocabulary and only per-token
        statistics cross ranks (`tp_train.vocab_parallel_cross_entropy`); otherwise `F.cross_entropy`. Logits in
        half precision are reduced in fp32."""
        self._steps.count_targets(target, ignore_index)  # under a pipeline: each microbatch's share of the batch
        group = self.tensor_parallel_group if self._loss.loss_parallel else None
        return self._loss.cross_entropy(self.lightning_module, group, logits, target, ignore_index, label_smoothing)

    def batch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """For logging: the batch's loss from this rank's `loss` (its training or validation step's), as one process
        would compute it on the whole batch: the mean over the data x context parallel ranks (`replica_group`), each
        weighted by the targets `cross_entropy` counted in its step (by 1 where none went through it). The gradients
        are untouched. Under a pipeline, `loss` itself: the pipeline logs the batch's after its last microbatch."""
        weight = self._loss.targets if self._loss.targets is not None else 1.0
        return self._steps.batch_loss(loss, weight)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # the head and the loss fused, where they may be; the tokens dropped over the experts' capacity logged
        module = self.lightning_module
        step = partial(self._steps.training_step, super().training_step, *args, **kwargs)
        with self.parallel_training.experts.counting_drops(module, module.log, self.root_device):
            return self._loss.step(module, step)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._steps.backward(super().backward, closure_loss, *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        step = partial(self._steps.validation_step, super().validation_step, *args, **kwargs)
        return self._loss.step(self.lightning_module, step)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.test_step(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._steps.predict_step(super().predict_step, *args, **kwargs)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self.parallel_training.after_backward()

    @contextmanager
    @override
    def block_backward_sync(self):
        """No data-parallel gradient reduction while Lightning accumulates micro-batches (`ParallelTraining.no_sync`);
        the last micro-batch's backward reduces the sum."""
        with self.parallel_training.no_sync():
            yield
