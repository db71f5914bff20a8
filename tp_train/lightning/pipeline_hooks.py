"""The step hooks `TensorParallelStrategy` overrides under a pipeline (a mixin before DDPStrategy): training_step runs
the schedule (`tp_train.lightning.pipeline`), backward only lands its gradients, validation and test run forward
through it, predict is refused. Without a pipeline each hook is Lightning's own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import override

from tp_train.lightning.pipeline import LightningPipeline


class PipelineStepHooks:
    """Mixin for a Lightning strategy holding `_pipeline` (None without one) and `pipeline_parallel_size`."""

    _pipeline: LightningPipeline | None = None
    pipeline_parallel_size: int = 1

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().training_step(*args, **kwargs)
        with self.precision_plugin.train_step_context():  # the schedule runs forward and backward
            batch = args[0] if args else kwargs["batch"]
            batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
            step = self.lightning_module.training_step
            scaler = getattr(self.precision_plugin, "scaler", None)  # 16-mixed: the loss scaled as Lightning would
            one = torch.ones((), device=self.root_device)
            self._pipeline.loss_scale = scaler.scale(one) if scaler is not None and scaler.is_enabled() else None
            return self._pipeline.training_step(step, batch, batch_idx, self.root_device)

    @override
    def backward(self, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self._pipeline is None:
            return super().backward(closure_loss, *args, **kwargs)
        # The schedule ran backward in training_step; its gradients land now, divided as Lightning divides the loss,
        # between the precision plugin's hooks (on_before_backward, on_after_backward for the callbacks)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._pipeline.backward(1.0 / module.trainer.accumulate_grad_batches)
        # the strategy's own, where the gradients are averaged over the data-parallel replicas, before the module's
        # on_after_backward sees them (as DDP's are, in its backward)
        self.post_backward(closure_loss)
        self.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().validation_step(*args, **kwargs)
        return self._evaluate(self.lightning_module.validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            return super().test_step(*args, **kwargs)
        return self._evaluate(self.lightning_module.test_step, *args, **kwargs)

    def _evaluate(self, step: Callable, *args: Any, **kwargs: Any) -> Any:
        assert self._pipeline is not None
        batch = args[0] if args else kwargs["batch"]
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx", 0)
        with self.precision_plugin.val_step_context():  # the schedule's forward only
            return self._pipeline.evaluation_step(step, batch, batch_idx, self.root_device)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        self._refuse_under_pipeline("predict")
        return super().predict_step(*args, **kwargs)

    def _refuse_under_pipeline(self, what: str) -> None:
        if self._pipeline is not None:
            raise NotImplementedError(
                f"{what} does not run through the pipeline yet (pipeline_parallel_size={self.pipeline_parallel_size});"
                f" {what} with pipeline_parallel_size=1"
            )
