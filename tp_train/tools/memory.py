"""Predicted per-rank memory of a tensor-parallel training run, before any rank starts."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from functools import cached_property

import torch.nn as nn

from tp_train.parallel.context_parallel.ring_attention import workspace_bytes
from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.mesh import DATA_PARALLEL_MODES
from tp_train.parallel.sharding import ShardSpec, ceil_div, data_parallel_shard_dim
from tp_train.plan.applying.adapters import adapter_specs
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.layout import blocks_if_any
from tp_train.plan.styles import PlannedModule, adapted_base, adapted_model, parameter_shard_spec, style_shard_spec
from tp_train.tools.activation_model import (
    PRECISION_BYTES,
    activation_parts,
    attention_shape,
    model_shape,
)
from tp_train.tools.pipeline_memory import in_flight, rank_parameter_ids, rank_stages
from tp_train.training.pipeline_split import plan_pipeline_split

MIB = 2**20
ADAMW_STATES = 2  # exp_avg and exp_avg_sq, each the size of its parameter


@dataclass
class MemoryEstimate:
    """Predicted bytes per rank."""

    parameters: int
    gradients: int
    optimizer_states: int
    gradient_buckets: int  # DDP's flat gradient buckets, with data parallelism
    activations: int  # kept for backward, per micro-batch, with the loss's logits and their gradients
    gathered_parameters: int = 0  # FSDP2's unsharded parameters of the groups in use (fsdp only)
    attention_workspace: int = 0  # what one attention's backward allocates beyond the activations (its kernels)
    receive_buffers: int = 0  # a pipeline stage's, one per microbatch for activations in and for gradients in (torch's)
    pipelined: bool = False  # a pipeline stage: its gradients are allocated while microbatches are still in flight

    @property
    def total(self) -> int:
        """The peak: gradients are allocated while the backward pass frees the activations (in a pipeline, at the
        first microbatch's backward, beside the activations of those still in flight); one attention's backward at
        a time adds its kernels' workspace to the activations."""
        gathered = self.gradient_buckets + self.gathered_parameters + self.receive_buffers
        working = self.activations + self.attention_workspace
        grown = self.gradients + working if self.pipelined else max(self.gradients, working)
        return self.parameters + self.optimizer_states + gathered + grown

    @property
    def model_states(self) -> int:
        """Parameters, gradients and optimizer states."""
        return self.parameters + self.gradients + self.optimizer_states

    def table(self, title: str = "predicted memory per rank") -> str:
        rows = [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self) if f.type == "int"]
        rows.append(("peak", self.total))
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"{title}:", *(f"  {name:<{width}}  {value / MIB:10.1f} MiB" for name, value in rows)])


def parameters_per_rank(
    model: nn.Module,
    tp: int,
    plan: dict[str, str] | None = None,
    dp: int = 1,
    data_parallel: str = "ddp",
    trainable: bool = False,
    only: set[int] | None = None,
) -> int:
    """Elements of the parameters one rank holds once `model` is sharded over `tp` ranks with `plan` (default: the
    model's own, as `parallelize` resolves it), and with `data_parallel="fsdp"` over `dp` ranks once more (rank 0,
    whose piece of an uneven split is the largest); with `trainable`, of those that train only (which have
    gradients and optimizer states: a model's adapters, not its frozen base); with `only`, of the parameters whose
    id() it holds (a pipeline rank's)."""
    _check_data_parallel(data_parallel)
    model = _planned_model(model)
    return _elements(model, _local_shapes(model, tp, plan), dp, data_parallel, trainable, only)


def _check_data_parallel(data_parallel: str) -> None:
    if data_parallel not in DATA_PARALLEL_MODES:
        raise ValueError(f"data_parallel={data_parallel!r}: use one of {DATA_PARALLEL_MODES}")


def _elements(model, shapes: dict, dp: int, data_parallel: str, trainable: bool, only: set[int] | None) -> int:
    """`parameters_per_rank` from the local `shapes` (`_local_shapes`)."""
    if trainable:
        training = {id(param) for param in model.parameters() if param.requires_grad}
        shapes = {key: value for key, value in shapes.items() if key in training}
    if only is not None:
        shapes = {key: value for key, value in shapes.items() if key in only}
    if data_parallel == "ddp":
        return sum(math.prod(shape) for shape, _ in shapes.values())
    return sum(math.prod(_data_parallel_piece(shape, spec, dp)) for shape, spec in shapes.values())


def _planned_model(model: nn.Module) -> nn.Module:
    """The model a peft wrapper holds (planned in its own names, as `parallelize` plans it), or `model`."""
    wrapped = adapted_model(model)
    return wrapped[1] if wrapped is not None else model


def _local_shapes(model: nn.Module, tp: int, plan: dict[str, str] | None) -> dict[int, tuple[tuple, ShardSpec | None]]:
    """id(parameter) -> (its shape on one tensor-parallel rank, its ShardSpec or None); tied parameters once."""
    planned = match_plan(model, resolve_plan(model, plan, tensor_parallel_size=tp)[0], tp)
    local: dict[int, tuple[tuple, ShardSpec | None]] = {id(p): (tuple(p.shape), None) for p in model.parameters()}
    for entry in planned:
        base = adapted_base(entry.module) or entry.module  # a LoRA layer's base, its adapters after
        params = {name: (param, _shard_spec(entry, name)) for name, param in base.named_parameters(recurse=False)}
        if base is not entry.module and params.get("weight", (None, None))[1] is not None:
            adapters = adapter_specs(entry.module, entry.style, params["weight"][1])
            params |= {name: (entry.module.get_parameter(name), spec) for name, spec in adapters.items()}
        for param, spec in params.values():
            if spec is not None:
                shape = list(reversed(param.shape)) if spec.transposed else list(param.shape)
                shape[spec.dim] = sum(spec.local_sections(tp))
                local[id(param)] = (tuple(shape), spec)
    return local


def _data_parallel_piece(shape: tuple, spec: ShardSpec | None, dp: int) -> tuple:
    """Rank 0's piece of a tensor-parallel shard of `shape` that FSDP2 splits over `dp` ranks."""
    if not shape:
        return shape
    dim = data_parallel_shard_dim(shape, spec, dp)
    return shape[:dim] + (ceil_div(shape[dim], dp),) + shape[dim + 1 :]


def _gathered_elements(model: nn.Module, shapes: dict, blocks: list[str], only: set[int] | None = None) -> int:
    """Unsharded elements FSDP2 holds at once: the group outside the blocks and two blocks (see the docstring); with
    `only`, among the parameters whose id() it holds (a pipeline rank's). `shapes`: `_local_shapes`."""
    if only is not None:
        shapes = {key: value for key, value in shapes.items() if key in only}
    per_block = [
        sum(math.prod(shapes[id(p)][0]) for p in model.get_submodule(name).parameters() if id(p) in shapes)
        for name in blocks
    ]
    total = sum(math.prod(shape) for shape, _ in shapes.values())
    return total - sum(per_block) + 2 * max(per_block, default=0)


def _shard_spec(entry: PlannedModule, name: str) -> ShardSpec | None:
    if name in entry.parameters:  # a plan entry naming the parameter itself (fused MoE expert weights)
        return parameter_shard_spec(entry.parameters[name], entry.module, name)
    return style_shard_spec(entry.style, entry.module, name, entry.counts, entry.arguments)


def activation_bytes(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    tp: int = 1,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    loss_parallel: bool = False,
) -> int:
    """Bytes a micro-batch holds for backward on one rank at the step's peak (the loss's forward), by precision.

    One precision: `activation_elements` at its width. Mixed precision (autocast): the residual stream and the
    norms' inputs stay fp32 (2 per block, with the stream's ends); each linear saves its own low-precision copy of
    its input (q, k, v and fc cast the same norm output separately) and autocast's low-precision copy of its weight;
    the blocks' other tensors are low precision. `F.cross_entropy` turns the logits to fp32 (four fp32 tensors of
    them); the vocabulary-parallel loss keeps the logits in their dtype and adds up to two fp32 chunks (CHUNK_BYTES)."""
    parts = activation_parts(
        model,
        micro_batch_size,
        seq_len,
        tp,
        precision,
        sequence_parallel,
        loss_parallel,
        parameters_per_rank(model, tp),
    )
    return parts.total(model_shape(model)[0], activation_checkpointing)


def estimate_memory(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    tp: int = 1,
    dp: int = 1,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    plan: dict[str, str] | None = None,
    data_parallel: str = "ddp",
    loss_parallel: bool = False,
    cp: int = 1,
    pp: int = 1,
    pipeline_schedule: str = "1f1b",
    pipeline_microbatches: int | None = None,
    pipeline_virtual_stages: int = 1,
    dp_shard: int | None = None,
) -> MemoryEstimate:
    """Per-rank memory of training `model` with AdamW at `pp` x `dp` x `cp` x `tp` (see the module docstring); with
    `pp` > 1, of the pipeline rank that holds the most.

    Args:
        model: the unsharded model; built on the meta device is enough.
        micro_batch_size: sequences per micro-batch on one data-parallel rank (with `pp` > 1, the batch the schedule
            splits into `pipeline_microbatches`).
        seq_len: tokens per sequence.
        precision: one of Lightning's names ("32-true", "16-mixed", "bf16-mixed", "bf16-true", ...).
        data_parallel: "ddp" or "fsdp", as `TensorParallelStrategy(data_parallel=...)`.
        loss_parallel: the LM head's logits stay sharded along the vocabulary (`TensorParallelStrategy`'s
            `loss_parallel`).
        cp: context-parallel size: each rank holds seq_len / cp tokens of every sequence (its activations), and
            parameters are replicated over dp x cp (FSDP2 shards them over dp x cp, DDP reduces over it).
        pp, pipeline_schedule, pipeline_microbatches, pipeline_virtual_stages: the pipeline (`TensorParallelStrategy`'s
            arguments of those names; microbatches default to `pp`): each rank holds its stages' parameters and the
            activations of the microbatches its schedule keeps in flight (`tp_train.tools.pipeline_memory`).
        dp_shard: HSDP (`data_parallel="fsdp"` only): FSDP2 splits the model state over groups of `dp_shard` of the
            `dp` ranks (times cp), replicated across the groups, as `TensorParallelStrategy(data_parallel_shard_size=)`.
    """
    if precision not in PRECISION_BYTES:
        raise ValueError(f"estimate_memory: precision={precision!r} is not one of {sorted(PRECISION_BYTES)}")
    _check_data_parallel(data_parallel)
    model = _planned_model(model)
    dims = ParallelDims.from_world(
        ParallelDims.devices_for(dp=dp, tp=tp, cp=cp, pp=pp), tp=tp, cp=cp, pp=pp, data_parallel=data_parallel,
        virtual_stages=pipeline_virtual_stages, dp_shard=dp_shard,
    )  # fmt: skip
    if dp_shard is not None:
        dims.validate()  # a shard size that does not divide dp, in one line
    # the ranks FSDP2 splits the model state over (one shard group's, under HSDP), or DDP's copies of it
    holding = dims.shard_ranks if data_parallel == "fsdp" else dims.dp_cp
    rank = _RankMemory(model, seq_len, tp, holding, precision, sequence_parallel, activation_checkpointing, plan,
                       data_parallel, loss_parallel, cp)  # fmt: skip
    if pp == 1:
        return rank.estimate(micro_batch_size, None, model_shape(model)[0], in_flight=1, last=True, pipelined=False)
    microbatches = pipeline_microbatches or pp
    if micro_batch_size % microbatches:
        raise ValueError(
            f"estimate_memory: pipeline_microbatches={microbatches} does not divide the micro-batch of "
            f"{micro_batch_size} sequences; use a divisor of it"
        )
    split = plan_pipeline_split(model, dims.stages)
    # one microbatch's hidden state, as a stage sends it on (its tokens split over tp under sequence parallelism)
    tokens = micro_batch_size // microbatches * -(-seq_len // cp) // (tp if sequence_parallel else 1)
    boundary = tokens * model_shape(model)[1] * PRECISION_BYTES[precision][0]
    estimates = []
    for pipeline_rank in range(pp):
        stages = rank_stages(pipeline_schedule, split.num_stages, pp, pipeline_rank, dims.virtual_stages)
        estimate = rank.estimate(
            micro_batch_size // microbatches,
            only=rank_parameter_ids(model, split, stages),
            blocks=sum(len(split.stages[stage]) for stage in stages),
            in_flight=in_flight(pipeline_schedule, pp, pipeline_rank, microbatches, pipeline_virtual_stages),
            last=split.num_stages - 1 in stages,
            pipelined=True,
        )
        # torch's stages hold a buffer per microbatch for what they receive: activations from the stage before
        # (all but the first stage), gradients from the stage after (all but the last)
        receiving = sum((stage > 0) + (stage < split.num_stages - 1) for stage in stages)
        estimates.append(replace(estimate, receive_buffers=receiving * microbatches * boundary))
    return max(estimates, key=lambda estimate: estimate.total)


@dataclass
class _RankMemory:
    """`estimate_memory`'s settings, estimating one rank that holds some of the parameters and blocks."""

    model: nn.Module
    seq_len: int
    tp: int
    replicas: int  # ranks holding the same parameters: dp x cp
    precision: str
    sequence_parallel: bool
    activation_checkpointing: bool
    plan: dict[str, str] | None
    data_parallel: str
    loss_parallel: bool
    cp: int

    @cached_property
    def shapes(self) -> dict[int, tuple[tuple, ShardSpec | None]]:
        return _local_shapes(self.model, self.tp, self.plan)

    @cached_property
    def blocks(self) -> list[str]:
        planned = match_plan(self.model, resolve_plan(self.model, self.plan, tensor_parallel_size=self.tp)[0], self.tp)
        return blocks_if_any(self.model, planned)

    def estimate(self, micro_batch, only: set[int] | None, blocks, in_flight: float, last: bool, pipelined: bool):
        """`only`: the parameters' ids (None: all); `blocks` of the model's, `in_flight` micro-batches of `micro_batch`
        sequences held at once; `last`: the rank computes the loss; `pipelined`: a pipeline stage."""
        param_bytes, activation_width = PRECISION_BYTES[self.precision]
        model, tp, shapes, fsdp = self.model, self.tp, self.shapes, self.data_parallel == "fsdp"
        parameters = _elements(model, shapes, self.replicas, self.data_parallel, False, only)
        trained = _elements(model, shapes, self.replicas, self.data_parallel, True, only) * param_bytes
        parts = activation_parts(  # ring attention keeps no score matrix: activations follow the local tokens
            model, micro_batch, -(-self.seq_len // self.cp), tp, self.precision, self.sequence_parallel,
            self.loss_parallel, parameters=_elements(model, shapes, 1, "ddp", False, only),
        )  # fmt: skip
        q_heads, kv_heads, head_dim = attention_shape(model)
        workspace = workspace_bytes(  # at cp=1 the model's SDPA: the same fused kernel, nothing travelling
            micro_batch,
            max(1, q_heads // tp),
            max(1, kv_heads // tp),
            head_dim,
            self.seq_len,
            self.cp,
            element_size=activation_width,
        )
        gathered = _gathered_elements(model, shapes, self.blocks, only) * activation_width if fsdp else 0
        return MemoryEstimate(
            parameters=parameters * param_bytes,
            gradients=trained,
            optimizer_states=ADAMW_STATES * trained,
            gradient_buckets=trained if self.replicas > 1 and not fsdp else 0,
            activations=parts.total(blocks, self.activation_checkpointing, loss=last, in_flight=in_flight),
            gathered_parameters=gathered,
            attention_workspace=workspace,
            pipelined=pipelined,
        )


def tensor_parallel_bytes_per_step(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    tp: int,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    loss_parallel: bool = False,
) -> int:
    """Bytes the tensor-parallel collectives of one training step move (as `CommunicationCounter` counts them: an
    all-reduce twice, as the reduce-scatter plus all-gather it is) for a transformer sharded Megatron's way, its LM
    head gathering the logits (none of them with `loss_parallel`).
    """
    if tp == 1:
        return 0
    layers, hidden, _, vocab = model_shape(model)
    tokens = micro_batch_size * seq_len
    per_block = 8 + (2 if activation_checkpointing else 0)
    elements = (per_block * layers + (5 if sequence_parallel else 4)) * tokens * hidden
    if not loss_parallel:  # the vocabulary-parallel loss's per-token all-reduces are not the model's: not counted
        elements += tokens * ceil_div(vocab, tp) * tp
    return elements * 4  # fp32, as the counter sees it
