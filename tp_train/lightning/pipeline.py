"""Pipeline parallelism inside `TensorParallelStrategy`: the user's `training_step` runs unchanged, once per
microbatch, while torch's schedule (`tp_train.parallel.pipeline.Pipeline`) runs the model's stages. This is the one
module of lightning/ that looks at the pipeline: `step_runner` chooses, once at setup, the runner the strategy's step
hooks call (`PipelineSteps` here, or `tp_train.lightning.steps.ModelSteps` without a pipeline).

How one step goes, on every rank of the pipeline group:
1. The batch is split along dim 0 into the microbatches. Where the first stage is, `training_step` runs on each of
   them until it calls the model, which stops it: what it passes to the model is that microbatch's input.
2. The schedule runs the stages over the microbatches. On the last stage, its loss for microbatch k is the user's
   `training_step` on microbatch k, with the model standing in by the stage's output: the user computes the loss
   their own way. `strategy.cross_entropy` there counts the microbatch's targets, so the gradients are those of the
   batch's token-weighted mean (a mean of the microbatches' means where the loss does not go through it).
3. Tied parameters' gradients are summed across stages; the loss, and what `training_step` logged, are broadcast
   from the last stage and logged on every rank, so `self.log`, callbacks and the progress bar see the batch's: the
   loss logged is the whole batch's, over the data x context parallel replicas too (weighted by their targets).
The runner owns backward: the schedule runs it in `training_step`, and Lightning's `backward` (after its
`zero_grad`) only adds those gradients to the parameters. Validation and test run forward through the schedule;
predict is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.strategies import Strategy

from tp_train.lightning.leaf_steps import LeafSteps
from tp_train.lightning.steps import ModelSteps, batch_arguments, logs_kept
from tp_train.parallel.invariant import FAST
from tp_train.training import ParallelTraining
from tp_train.training.apply_order import pipelined_model


class _Captured(Exception):  # noqa: N818 - control flow: training_step called the model, with these inputs
    def __init__(self, args: tuple) -> None:
        super().__init__()
        self.args = args


class _CaptureInput(nn.Module):
    def forward(self, *args, **kwargs):
        raise _Captured(args)


class _StageOutput(nn.Module):
    """Stands in for the model in the last stage's `training_step`: returns that stage's output for the microbatch."""

    def __init__(self, output: Any, model: nn.Module) -> None:
        super().__init__()
        self.output = output
        if hasattr(model, "tp_context_parallel"):  # the loss finds the model's context-parallel group on it
            self.tp_context_parallel = model.tp_context_parallel

    def forward(self, *args, **kwargs):
        return self.output


class PipelineSteps:
    """The strategy's step runner under a pipeline (the interface of `tp_train.lightning.steps.ModelSteps`): the
    user's step methods run through `pipeline` (this rank's stages of the LightningModule's model, cut by
    `tp_train.training.parallelize_for_training`); Lightning's own hooks (`default`) are not called.

    The logged loss is the batch's over the data x context parallel ranks (other tokens, the same parameters:
    `training.batch_loss`); the gradients' average over them is `training.after_backward`'s, which the strategy's
    `post_backward` runs."""

    def __init__(self, strategy: Strategy, training: ParallelTraining) -> None:
        self.strategy = strategy
        self.module = strategy.lightning_module
        self.name, _ = pipelined_model(self.module)
        self.training = training
        self.pipeline = pipeline = training.pipeline
        pipeline.loss_fn = self._microbatch_loss  # the user's training_step on the last stage's output
        self.split = pipeline.split
        self.microbatches = pipeline.microbatches
        # 16-mixed: the scaler's scale, by which each microbatch's loss is multiplied before the schedule's backward
        # (Lightning scales the loss before its own backward; here the schedule runs it)
        self.loss_scale: torch.Tensor | None = None
        # per microbatch, where strategy.cross_entropy counted them: its targets not ignored, over the batch's size
        self.token_counts: list[float] | None = None
        self._targets: list[int] = []  # the same counts, whole: the weight of this replica's loss among the others'
        self._batch: list[Any] = []
        self._step: Callable | None = None
        self._batch_idx = 0
        self._training = True
        self._logged: list[list[tuple[str, Any, dict]]] = []
        self._losses: list[torch.Tensor] = []
        self._pending: dict[nn.Parameter, torch.Tensor] = {}  # the last step's gradients, until backward

    def training_step(self, default: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The user's training_step through the pipeline over the microbatches of the batch, forward and backward;
        returns the batch's loss (this replica's) on every rank; the gradients wait for `backward`."""
        precision, device = self.strategy.precision_plugin, self.strategy.root_device
        with precision.train_step_context():
            scaler = getattr(precision, "scaler", None)  # 16-mixed: the loss scaled as Lightning would
            one = torch.ones((), device=device)
            self.loss_scale = scaler.scale(one) if scaler is not None and scaler.is_enabled() else None
            held = self.pipeline.set_aside_gradients()
            loss, divisor = self._run(self.module.training_step, *batch_arguments(args, kwargs), device, train=True)
            self.pipeline.finish_gradients({}, 1.0 / divisor)
            # Lightning zeroes the gradients after training_step and before backward: this step's wait for `backward`
            self._pending = self.pipeline.set_aside_gradients()
            for param, grad in held.items():
                param.grad = grad
            return loss

    def backward(self, default: Callable, closure_loss: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The schedule ran backward in training_step; its gradients land now, divided as Lightning divides the loss
        (by accumulate_grad_batches), between the precision plugin's hooks (on_before_backward, on_after_backward
        for the callbacks)."""
        precision, module = self.strategy.precision_plugin, self.module
        closure_loss = precision.pre_backward(closure_loss, module)
        scale = 1.0 / module.trainer.accumulate_grad_batches
        for param, grad in self._pending.items():  # added to the parameters' (after Lightning's zero_grad)
            grad = grad.mul_(scale) if scale != 1.0 else grad
            param.grad = grad if param.grad is None else param.grad + grad
        self._pending = {}
        # the strategy's own, where the gradients are averaged over the data-parallel replicas, before the module's
        # on_after_backward sees them (as DDP's are, in its backward)
        self.strategy.post_backward(closure_loss)
        precision.post_backward(closure_loss, module)
        return closure_loss

    def validation_step(self, default: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._evaluate(self.module.validation_step, args, kwargs)

    def test_step(self, default: Callable, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._evaluate(self.module.test_step, args, kwargs)

    def predict_step(self, default: Callable, *args: Any, **kwargs: Any) -> Any:
        size = self.strategy.pipeline_parallel_size
        raise NotImplementedError(
            f"predict does not run through the pipeline yet (pipeline_parallel_size={size}); predict with "
            f"pipeline_parallel_size=1"
        )

    def count_targets(self, target: torch.Tensor, ignore_index: int) -> None:
        """Called by strategy.cross_entropy inside the last stage's training_step: that microbatch's targets (not
        ignored) out of its size. Kept as a fraction of the batch's size (the microbatches are of one size): weighted
        by it, a microbatch's loss has the gradients it has in the whole batch's mean, of the same magnitude in fp16
        (a count would multiply them by the microbatch's tokens, overflowing fp16)."""
        if self.token_counts is not None:
            count = int((target != ignore_index).sum())
            self.token_counts.append(count / max(target.numel() * self.microbatches, 1))
            self._targets.append(count)

    def batch_loss(self, loss: torch.Tensor, weight: torch.Tensor | float) -> torch.Tensor:
        """`loss` itself: the batch's (over the replicas too) is logged after the last microbatch (`_run`)."""
        return loss

    def _evaluate(self, step: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """`step` (the user's validation_step or test_step) through the pipeline, forward only; the batch's loss
        (this replica's) on every rank, and what `step` logged logged on every rank."""
        with self.strategy.precision_plugin.val_step_context():  # the schedule's forward only
            device = self.strategy.root_device
            return self._run(step, *batch_arguments(args, kwargs), device, train=False)[0]

    def _run(self, step: Callable, batch: Any, batch_idx: int, device: torch.device, train: bool):
        self._batch = split_batch(batch, self.microbatches)
        self._step, self._logged, self._losses, self.token_counts, self._targets = step, [], [], [], []
        self._batch_idx, self._training = batch_idx, train
        inputs = None
        if self.pipeline.holds_first:
            inputs = torch.cat([self._model_input(step, part, batch_idx) for part in self._batch])
        self.pipeline.run(inputs, torch.arange(self.microbatches, device=device), train=train)
        # torch's first step infers the stages' shapes with a forward (and a loss) on placeholder tensors: keep the
        # microbatches' own, the last ones
        self.token_counts, self._targets = self.token_counts[-self.microbatches :], self._targets[-self.microbatches :]
        self._losses, self._logged = self._losses[-self.microbatches :], self._logged[-self.microbatches :]
        counted = self.pipeline.holds_last and len(self.token_counts) == self.microbatches
        # The divisor: the sum of the fractions counted where every microbatch's loss counted its own (the batch's
        # targets over its size), else the microbatches.
        divisor = sum(self.token_counts) if counted else float(self.microbatches)
        weight = float(sum(self._targets)) if counted else 1.0  # among the replicas: its targets, or 1 (uncounted)
        total = torch.stack(self._losses).sum() if self._losses else torch.zeros((), device=device)
        # float32 whatever the default dtype (bf16 in a bf16-true step would round a count of targets above 256)
        value = torch.cat(
            [total.float().reshape(1), torch.tensor([divisor, weight], device=device, dtype=torch.float32)]
        )
        last = self.pipeline.holds_last
        loss_sum, divisor, weight = self.pipeline.from_last_stage(value if last else None, device, size=3)
        loss = loss_sum / divisor  # this replica's batch: what training_step returns
        self._log_on_every_rank(self.training.batch_loss(loss, weight))
        return loss, divisor.item()

    def _model_input(self, step: Callable, part: Any, batch_idx: int) -> torch.Tensor:
        with self._model_as(_CaptureInput()), self._logs_dropped():
            try:
                step(part, batch_idx)
            except _Captured as captured:
                return captured.args[0]
        raise RuntimeError(f"pipeline: {type(self.module).__name__}.training_step never called self.{self.name}")

    def _microbatch_loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss_fn on the last stage: the user's training_step on microbatch `index`, weighted by the
        fraction of its targets counted (when it counted them; the gradients are divided by the batch's sum of those
        later), times the loss scale under 16-mixed."""
        assert self._step is not None
        counted = len(self.token_counts)
        logged: list[tuple[str, Any, dict]] = []
        stand_in = _StageOutput(self.pipeline.model_output(output), getattr(self.module, self.name))
        with self._model_as(stand_in), self._logs_kept(logged):
            result = self._step(self._batch[int(index.reshape(-1)[0])], self._batch_idx)
        loss = result["loss"] if isinstance(result, dict) else result
        if loss is None and not self._training:  # a validation_step that only logs
            loss = torch.zeros((), device=index.device)
        elif loss is None:
            raise ValueError(
                f"{type(self.module).__name__}.training_step returned None, which skips a step under plain Lightning;"
                f" a pipeline's stages step together: return the loss on every batch"
            )
        self._logged.append([(name, value is result or value is loss, value, kw) for name, value, kw in logged])
        weight = self.token_counts[-1] if len(self.token_counts) == counted + 1 else 1
        weighted = loss * weight
        self._losses.append(weighted.detach())
        return weighted * self.loss_scale if self.loss_scale is not None else weighted

    def _log_on_every_rank(self, loss: torch.Tensor) -> None:
        """What training_step logged on the last stage, logged on every rank: the loss as `loss` (the whole batch's,
        over the replicas too), any other value as its mean over the microbatches."""
        entries = None
        if self.pipeline.holds_last and self._logged:
            entries = []
            for position, (name, is_loss, _, kwargs) in enumerate(self._logged[0]):
                values = [float(torch.as_tensor(logs[position][2]).float().mean()) for logs in self._logged]
                entries.append((name, is_loss, sum(values) / len(values), kwargs))
        box = [entries]
        dist.broadcast_object_list(box, group=self.pipeline.group, group_src=self.pipeline.last_rank)
        for name, is_loss, value, kwargs in box[0] or []:
            self.module.log(name, loss if is_loss else torch.tensor(value, device=loss.device), **kwargs)

    @contextmanager
    def _model_as(self, stand_in: nn.Module):
        model = getattr(self.module, self.name)
        setattr(self.module, self.name, stand_in)
        try:
            yield
        finally:
            setattr(self.module, self.name, model)

    @contextmanager
    def _logs_dropped(self):
        with self._logs_kept([]):
            yield

    def _logs_kept(self, into: list):
        return logs_kept(self.module, into)


def step_runner(strategy: Strategy, training: ParallelTraining) -> ModelSteps | PipelineSteps | LeafSteps:
    """The runner of `strategy`'s step hooks for the model `training` holds, chosen once at setup: through its
    pipeline where it has one; in leaves under `numerics="invariant"` (at every dp, so that dp=1 runs the leaves dp=2
    runs); else Lightning's own steps. `strategy` is the `TensorParallelStrategy`."""
    if training.pipeline is not None:
        return PipelineSteps(strategy, training)
    if training.numerics != FAST:
        return LeafSteps(strategy, training)
    return ModelSteps(training)


def split_batch(batch: Any, microbatches: int) -> list[Any]:
    """`batch` (a tensor, or a tuple/list/dict of them) as `microbatches` equal parts along dim 0; one-line error when
    they do not divide its size."""
    if isinstance(batch, torch.Tensor):
        if batch.shape[0] % microbatches:
            raise ValueError(
                f"pipeline_microbatches={microbatches} does not divide the batch size {batch.shape[0]}; use a batch "
                f"size that is a multiple of it"
            )
        return list(batch.chunk(microbatches))
    if isinstance(batch, (list, tuple)):
        parts = [split_batch(item, microbatches) for item in batch]
        return [type(batch)(part[k] for part in parts) for k in range(microbatches)]
    if isinstance(batch, dict):
        parts = {key: split_batch(value, microbatches) for key, value in batch.items()}
        return [{key: value[k] for key, value in parts.items()} for k in range(microbatches)]
    return [batch] * microbatches
