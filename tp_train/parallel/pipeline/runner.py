"""A model run as a pipeline on this rank: its stages (cut from copies of the model), torch's schedule over them,
and one training step over microbatches with a token-weighted loss, tied gradients summed and the batch's loss on
every rank. Nothing here knows of Lightning."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.pipelining import PipelineStage

from tp_train.parallel.fake_ranks import real_values
from tp_train.parallel.pipeline.schedules import schedule_named
from tp_train.parallel.pipeline.split import PipelineSplit
from tp_train.parallel.pipeline.stage import StageForward, cut_stage, cut_stages
from tp_train.parallel.pipeline.ties import Tie, sum_tied_gradients, tied_parameters

IGNORE_INDEX = -100


class TokenWeightedCrossEntropy:
    """The loss of one microbatch as its share of the batch's mean: the sum of its tokens' cross-entropies over the
    batch's count of targets (not ignored). Summed over the microbatches it is the batch's mean, whatever the
    microbatches' padding; the schedule then runs with `scale_grads=False`."""

    def __init__(self, ignore_index: int = IGNORE_INDEX) -> None:
        self.ignore_index = ignore_index
        self.batch_tokens = 1

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        total = F.cross_entropy(
            logits.flatten(0, -2), target.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )
        return total / self.batch_tokens


def refuse_sharded_ties(ties: list[Tie], size: int) -> None:
    """One line for tied parameters over more than 2 stages with FSDP2: a middle stage, holding no copy, would add
    zeros of the tensor-parallel shard's shape to the copies' data-parallel shards."""
    if ties and size > 2:
        raise ValueError(
            f"pipeline_parallel_size={size} with data_parallel='fsdp' and tied parameters ('{ties[0].names[0]}') is "
            f"not supported yet (only 2 stages are); use pipeline_parallel_size=2 or data_parallel='ddp'"
        )


def average_gradients(parameters: list[nn.Parameter], group: ProcessGroup) -> None:
    """Averages the gradients of `parameters` over `group` (DDP's all-reduce, once per step: one flat bucket per
    dtype). Every rank of `group` holds the same parameters, so the buckets line up."""
    grads: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in parameters:
        if param.grad is not None:
            grads.setdefault(param.grad.dtype, []).append(param.grad)
    for same_dtype in grads.values():
        flat = torch.cat([grad.reshape(-1) for grad in same_dtype])
        dist.all_reduce(flat, group=group)
        flat.div_(dist.get_world_size(group))
        for grad, average in zip(same_dtype, flat.split([grad.numel() for grad in same_dtype]), strict=True):
            grad.copy_(average.view_as(grad))


def stage_indices(num_stages: int, placement: str, rank: int, size: int) -> list[int]:
    """The stages pipeline rank `rank` of `size` runs: looped (rank r: r, r + pp, ...), or V-placed (`placement` "v":
    stages r and 2pp - 1 - r, the first and the last on rank 0)."""
    if placement == "v":
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, size))


class Pipeline:
    """`model`'s stages on this rank of `group` (the pipeline-parallel group), run by schedule `schedule_name`.

    Stage s runs on group rank s % pp (looped); with `virtual_stages` v > 1 a rank runs v stages. Each stage is a
    cut copy of `model` (`tp_train.parallel.pipeline.stage`); `models` are this rank's, whose parameters keep the
    model's names. Sends and receives go over `group` (gloo or NCCL point-to-point).

    Args:
        model: the whole model (left as it is; the stages are copies).
        split: where it splits (`tp_train.training.pipeline_split.plan_pipeline_split`), with pp x v stages.
        group: the pipeline-parallel process group.
        schedule_name: a name in `tp_train.parallel.pipeline.schedules.SCHEDULES`.
        microbatches: how many microbatches each step splits its batch into (along dim 0).
        loss_fn: the last stage's loss per microbatch, `loss_fn(output, target)`; by default the token-weighted
            cross-entropy (`TokenWeightedCrossEntropy`).
        in_place: cut `model` itself (a LightningModule's, whose parameters the optimizer holds) rather than copies;
            with several stages per rank each runs a view of it (`tp_train.parallel.pipeline.stage.cut_stages`).
        wrap: applied to each stage's module before torch's `PipelineStage` takes it: FSDP2's `fully_shard` over
            the data-parallel ranks, whose gradients the stage then reduce-scatters after the last microbatch only.
        replicas: the ranks holding this rank's stages whole (data x context parallel, DDP's group): the step's
            gradients are averaged over them once, after the last microbatch's backward.
    """

    def __init__(
        self,
        model: nn.Module,
        split: PipelineSplit,
        group: ProcessGroup,
        schedule_name: str,
        microbatches: int,
        device: torch.device,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        in_place: bool = False,
        wrap: Callable[[nn.Module], nn.Module] | None = None,
        replicas: ProcessGroup | None = None,
    ) -> None:
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        if split.num_stages % size:
            raise ValueError(f"{split.num_stages} pipeline stages do not spread evenly over {size} pipeline ranks")
        self.virtual_stages = split.num_stages // size
        self.schedule = schedule_named(schedule_name, self.virtual_stages)
        self.group, self.microbatches, self.split = group, microbatches, split
        self.replicas = replicas if replicas is not None and dist.get_world_size(replicas) > 1 else None
        self.ties = tied_parameters(model)
        if wrap is not None:
            refuse_sharded_ties(self.ties, size)
        self.stage_indices = stage_indices(split.num_stages, self.schedule.placement, rank, size)
        if in_place:  # the model keeps this rank's stages; each stage runs a view of it
            self.models = cut_stages(model, split, self.stage_indices)
        else:
            copies = [copy.deepcopy(model) for _ in self.stage_indices]
            self.models = [cut_stage(cut, split, index) for cut, index in zip(copies, self.stage_indices, strict=True)]
        wrap = wrap or (lambda module: module)
        self.stages = [
            PipelineStage(wrap(StageForward(cut, split, index)), index, split.num_stages, device, group=group)
            for cut, index in zip(self.models, self.stage_indices, strict=True)
        ]
        self.loss_fn = loss_fn if loss_fn is not None else TokenWeightedCrossEntropy()
        stages = self.stages if self.schedule.virtual else self.stages[0]
        self._torch_schedule = self.schedule.torch_class(
            stages, n_microbatches=microbatches, loss_fn=self._loss, scale_grads=False
        )
        # the group rank running the last stage
        self.last_rank = 0 if self.schedule.placement == "v" else (split.num_stages - 1) % size

    def _loss(self, output, target) -> torch.Tensor:
        return self.loss_fn(output, target)  # looked up per microbatch: a caller may set `loss_fn` after building

    @property
    def torch_schedule(self):
        """torch's schedule object running this rank's stages (its `pipeline_order`, where it has one, is its table
        of actions per time slot)."""
        return self._torch_schedule

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_indices

    @property
    def holds_last(self) -> bool:
        return self.split.num_stages - 1 in self.stage_indices

    def model_output(self, logits: torch.Tensor):
        """The last stage's output `logits` as the whole model returns them (`StageForward.model_output`)."""
        return self.stages[-1].submod.model_output(logits)

    def parameters(self):
        """This rank's parameters (each copy of a tied parameter once per stage that holds it)."""
        for model in self.models:
            yield from model.parameters()

    def duplicate_parameters(self) -> frozenset[int]:
        """`id()` of this rank's copies of tied parameters that an earlier stage also holds: a norm over the stages
        counts each tied parameter once, on the first stage holding it. Where this rank holds that stage too (a V
        schedule's rank 0 holds the first and the last), its copy is the same parameter, and counted."""
        duplicates, counted = set(), set()
        for model, stage in zip(self.models, self.stage_indices, strict=True):
            held = dict(model.named_parameters(remove_duplicate=False))
            for tie in self.ties:
                holders = [self._stage_holding(name) for name in tie.names]
                for name, holder in zip(tie.names, holders, strict=True):
                    if holder == stage and name in held:
                        (duplicates if stage > min(holders) else counted).add(id(held[name]))
        return frozenset(duplicates - counted)

    def _stage_holding(self, parameter: str) -> int:
        for stage in range(self.split.num_stages):
            if any(parameter.startswith(module + ".") for module in self.split.stage_modules(stage)):
                return stage
        raise ValueError(f"pipeline: no stage holds the tied parameter '{parameter}'")

    def train_step(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the batch (`ids`, `targets`: (B, T), B a multiple of the microbatches),
        gradients accumulated into this rank's parameters (tied copies summed). Returns the batch's mean loss over
        its targets (not ignored) on every rank of the group."""
        self._check_batch(ids)
        if isinstance(self.loss_fn, TokenWeightedCrossEntropy):
            with real_values():  # read here: real on a simulated rank too, from a real batch
                self.loss_fn.batch_tokens = int((targets != self.loss_fn.ignore_index).sum().clamp(min=1))
        held = self.set_aside_gradients()
        losses = self.run(ids, targets)
        self.finish_gradients(held)
        return self.from_last_stage(torch.stack(losses).sum() if losses else None, ids.device)

    def run(self, ids: torch.Tensor | None, target: torch.Tensor | None, train: bool = True) -> list[torch.Tensor]:
        """One pass of the schedule: `ids` go to the first stage, `target` (split like them) to `loss_fn` on the
        last; forward and backward with `train`, forward only without. Returns the last stage's per-microbatch
        losses (detached; empty elsewhere). Tied gradients are not summed yet (`sum_tied_gradients`)."""
        losses: list[torch.Tensor] = []
        inputs = (ids.contiguous(),) if self.holds_first else ()  # sent on to the next stage as they are
        keywords = {"target": target, "losses": losses} if self.holds_last else {}
        if train:
            self._torch_schedule.step(*inputs, **keywords, return_outputs=False)
        else:
            self._torch_schedule.eval(*inputs, **keywords)
        return [loss.detach() for loss in losses]

    def set_aside_gradients(self) -> dict[nn.Parameter, torch.Tensor]:
        """Takes the gradients accumulated so far off the parameters, so that a step's own are scaled and tied alone
        (`finish_gradients` adds them back)."""
        held = {}
        for param in self.parameters():
            if param.grad is not None:
                held[param], param.grad = param.grad, None
        return held

    def finish_gradients(self, held: dict[nn.Parameter, torch.Tensor], scale: float = 1.0) -> None:
        """This step's gradients times `scale`, averaged over the replicas, tied copies summed across stages, plus
        those `held` from before."""
        for param in self.parameters():
            if param.grad is not None and scale != 1.0:
                param.grad.mul_(scale)
        if self.replicas is not None:
            average_gradients(list(self.parameters()), self.replicas)
        sum_tied_gradients(self.models, self.ties, self.group)
        for param in self.parameters():
            if param in held:
                param.grad = held[param] if param.grad is None else held[param] + param.grad

    def from_last_stage(self, value: torch.Tensor | None, device: torch.device, size: int = 1) -> torch.Tensor:
        """`value` (fp32, `size` elements; None except on the last stage's rank) broadcast from the last stage. The
        buffer's dtype is explicit on every rank: under precision=64 the default dtype is float64 in a step."""
        if value is None:
            value = torch.zeros(size, device=device, dtype=torch.float32)
        else:
            value = value.detach().float().reshape(size)
        dist.broadcast(value, group=self.group, group_src=self.last_rank)
        return value if size > 1 else value[0]

    def _check_batch(self, ids: torch.Tensor) -> None:
        if ids.shape[0] % self.microbatches:
            raise ValueError(
                f"pipeline_microbatches={self.microbatches} does not divide the batch size {ids.shape[0]}; use a "
                f"batch size that is a multiple of it"
            )
