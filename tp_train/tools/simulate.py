"""One training step of any layout simulated in one process: the real sharding code (`parallelize_for_training`)
on fake tensors over torch's fake process group, its memory counted storage by storage (`LiveBytes`), at any world
size and for any rank, on this machine, with no rank started and no weight allocated.

What fake ranks cannot carry, and what is done instead:
- plan verification runs the model on real values: off (the plan is the model's own, or the one given);
- DDP's reducer needs real storage: the model is not wrapped, and its gradient buckets (one flat copy of the
  trainable parameters' gradients, torch's default) are added to the peak by arithmetic, as are its all-reduces
  (`ddp_buckets`: a first small bucket, then one per `DDP_BUCKET_BYTES`) to the step's collectives;
- a pipeline's stages exchange their shapes over the group: they are answered on the rank
  (`tp_train.tools.simulated_pipeline`), for the schedules of forwards and full backwards;
- a forward whose shapes depend on the data (a mixture of experts' dropless routing: `nonzero`, `bincount`) cannot
  run on fake tensors: refused in one line naming the operation, until a routing assumption stands in for the data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.parallel.fake_ranks import FAKE_BACKEND
from tp_train.parallel.mesh import REPLICAS
from tp_train.parallel.pipeline import schedule_named
from tp_train.tools.live_bytes import BUFFERS, KINDS, OPTIMIZER_STATES, PARAMETERS, RECEIVE_BUFFERS, LiveBytes
from tp_train.tools.memory import MIB
from tp_train.tools.simulated_pipeline import FirstBoundaryFound, simulated_pipeline
from tp_train.tools.step_counts import ALL_REDUCE, Collective, CollectiveCount, StepCounts
from tp_train.training.apply_order import TrainingOptions, parallelize_for_training, wrapped_by_ddp
from tp_train.training.parallel_training import ParallelTraining

SIMULATED_STEPS = 2  # the last one counted: the optimizer's states and the pipeline's buffers exist by then
# The pipeline schedules whose actions are forwards and full backwards (not split into input and weight gradients).
SIMULATED_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs")
DDP_BUCKET_BYTES = 25 * MIB  # DDP's default bucket_cap_mb; its first bucket is torch's _DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class SimulatedMemory:
    """Bytes one rank holds at the simulated step's peak, by kind (`tp_train.tools.live_bytes`), at that moment."""

    parameters: int  # this rank's shards
    gradients: int
    optimizer_states: int
    buffers: int  # the model's
    receive_buffers: int  # a pipeline's, one per microbatch for activations and for gradients (torch's)
    working: int  # activations kept for the backward, the backward's temporaries, FSDP2's gathered parameters
    gradient_buckets: int  # DDP's, by arithmetic (see the module docstring)

    @property
    def peak(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def table(self, title: str = "simulated memory per rank") -> str:
        rows = [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)] + [("peak", self.peak)]
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"{title}:", *(f"  {name:<{width}}  {value / MIB:10.1f} MiB" for name, value in rows)])


@dataclass(frozen=True)
class SimulatedStep:
    """One simulated training step on one rank: its memory at the peak, and what it computed and sent
    (`tp_train.tools.step_counts`: its FLOPs, dispatched operations, and collectives by kind and group)."""

    memory: SimulatedMemory
    flops: int
    operations: int
    memory_traffic: int  # bytes read and written by the operations that are not matrix products
    collectives: dict[Collective, CollectiveCount]


def simulate_memory(
    build: Callable[[], nn.Module],
    dims: ParallelDims,
    forward_backward: Callable[[ParallelTraining], object],
    options: TrainingOptions | None = None,
    rank: int = 0,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
) -> SimulatedMemory:
    """The memory `rank` of a `dims` job holds at the peak of a training step: `simulate_step(...).memory`."""
    return simulate_step(build, dims, forward_backward, options, rank, optimizer).memory


def simulate_step(
    build: Callable[[], nn.Module],
    dims: ParallelDims,
    forward_backward: Callable[[ParallelTraining], object],
    options: TrainingOptions | None = None,
    rank: int = 0,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
) -> SimulatedStep:
    """One training step of `rank` of a `dims` job: the memory it holds at its peak, and what it computes and sends.

    Args:
        build: makes the unsharded model (called under the fake mode: its weights hold no memory).
        dims: the degrees, validated (`ParallelDims.from_world(...)`).
        forward_backward: `forward_backward(training)` runs one forward and backward of what
            `parallelize_for_training` returned (`training.module(...)`, or `training.pipeline.train_step(...)`) on
            inputs it makes: fake, or real where the step reads them (a pipeline's batch: made under
            `tp_train.parallel.fake_ranks.real_values`); in the contexts the real step uses (Lightning's autocast
            wraps the forward; the benchmark's, the backward too). The simulator then runs `after_backward` and the
            optimizer, as the strategy does.
        options: as `TensorParallelStrategy` gives them; plan verification is switched off.
        rank: the rank simulated (its pipeline stage, its shard of an uneven split).
        optimizer: made over the sharded parameters; AdamW by default.
    """
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"simulate_memory: rank={rank} is outside the world of {dims.world_size} ranks")
    if dist.is_initialized():
        raise RuntimeError(
            "simulate_memory: a process group is already initialised here; simulate before the ranks start, or in a "
            "process of its own"
        )
    options = replace(options or TrainingOptions(), verify_plan=False)
    if dims.pp > 1:
        schedule = schedule_named(options.pipeline_schedule, dims.virtual_stages)  # its own refusal, before any work
        if schedule.name not in SIMULATED_SCHEDULES:
            raise ValueError(
                f"simulate_memory: pipeline_schedule={options.pipeline_schedule!r} is not simulated yet; use one of "
                f"{', '.join(SIMULATED_SCHEDULES)}, or estimate_memory"
            )
    boundary = _first_boundary(build, dims, forward_backward, options) if dims.pp > 1 else None
    return _simulated_step(build, dims, forward_backward, options, rank, optimizer, boundary)


@contextmanager
def _fake_rank(dims: ParallelDims, rank: int) -> Iterator[ParallelMesh]:
    """`rank` of a fake world of `dims.world_size` ranks and its mesh, under a fake tensor mode (real tensors may
    enter it: a step's batch, made real to be read)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend: here only

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield mesh
    finally:
        dist.destroy_process_group()


def _parallelized(build, dims, mesh, options) -> ParallelTraining:
    return parallelize_for_training(build(), dims, mesh, torch.device("cpu"), options, wrap_replicas=None)


def _first_boundary(build, dims, forward_backward, options) -> tuple:
    """The shapes the first pipeline stage sends on (see `tp_train.tools.simulated_pipeline`), from rank 0."""
    with _fake_rank(dims, 0) as mesh:
        training = _parallelized(build, dims, mesh, options)
        with simulated_pipeline(training.pipeline, None):
            try:
                _forward_backward(forward_backward, training)
            except FirstBoundaryFound as found:
                return found.metas
    raise RuntimeError("simulate_memory: the first pipeline stage sent nothing on in the first pass")


def _simulated_step(build, dims, forward_backward, options, rank, optimizer, boundary) -> SimulatedStep:
    """The bytes by kind at the peak of one step on `rank` (after a first, which makes the optimizer's states and the
    pipeline's buffers) and what that step counted, with DDP's buckets and their all-reduces where DDP would wrap."""
    with _fake_rank(dims, rank) as mesh, ExitStack() as stack:
        training = _parallelized(build, dims, mesh, options)
        sent = stack.enter_context(simulated_pipeline(training.pipeline, boundary)) if boundary is not None else {}
        trainable = [param for param in training.root.parameters() if param.requires_grad]
        step_optimizer = optimizer(trainable)
        live = LiveBytes(trainable)
        live.hold(training.root.parameters(), PARAMETERS)
        live.hold(training.root.buffers(), BUFFERS)
        counts = StepCounts(mesh.roles())
        with live, counts:  # every step: what one leaves alive (states, buffers, caches) is there in the next
            for _ in range(SIMULATED_STEPS):
                states = [t for state in step_optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
                live.hold(states, OPTIMIZER_STATES)
                live.hold(_pipeline_buffers(training.pipeline), RECEIVE_BUFFERS)
                live.reset_peak()  # the last step's peak, and its counts
                counts.reset()
                _forward_backward(forward_backward, training)
                training.after_backward()
                step_optimizer.step()
                step_optimizer.zero_grad()
        _check_boundaries(sent, boundary)
        buckets = 0
        if wrapped_by_ddp(training, options):
            buckets = sum(_bytes(param) for param in trainable)
            replicas = Collective(ALL_REDUCE, REPLICAS, tuple(dist.get_process_group_ranks(mesh.replicas.get_group())))
            count = counts.collectives.setdefault(replicas, CollectiveCount())
            count.calls += ddp_buckets(buckets)
            count.bytes += buckets
    memory = SimulatedMemory(**{kind: live.at_peak.get(kind, 0) for kind in KINDS}, gradient_buckets=buckets)
    return SimulatedStep(memory, counts.flops, counts.operations, counts.memory_traffic, dict(counts.collectives))


def ddp_buckets(gradient_bytes: int) -> int:
    """The all-reduces DDP makes of `gradient_bytes`: a first bucket of torch's first-bucket size, then buckets of
    `DDP_BUCKET_BYTES`."""
    first = dist._DEFAULT_FIRST_BUCKET_BYTES
    return 1 + -(-max(0, gradient_bytes - first) // DDP_BUCKET_BYTES) if gradient_bytes else 0


def _pipeline_buffers(pipeline) -> list[torch.Tensor]:
    """The receive buffers torch's pipeline stages allocated (per microbatch, for activations and gradients)."""
    buffers = []
    for stage in pipeline.stages if pipeline is not None else []:
        infos = [*stage.args_recv_info.values(), *stage.grad_recv_info.values()]
        buffers += [info.buffer for group in infos for info in group if isinstance(info.buffer, torch.Tensor)]
    return buffers


def _forward_backward(forward_backward, training: ParallelTraining) -> None:
    try:
        forward_backward(training)
    except (DataDependentOutputException, DynamicOutputShapeException) as error:
        raise ValueError(
            f"simulate_memory: {type(training.root).__name__}'s step has a shape that depends on the data "
            f"({error.func}, e.g. a mixture of experts' routing), which fake tensors cannot simulate yet; use "
            f"estimate_memory"
        ) from None


def _check_boundaries(sent: dict[int, tuple], boundary: tuple | None) -> None:
    """Every stage this rank held sent on what the first stage did (what the others were simulated to receive)."""
    for stage, metas in sent.items():
        if metas != boundary:
            raise ValueError(
                f"simulate_memory: pipeline stage {stage} sends {_shapes(metas)} on, where the first stage sends "
                f"{_shapes(boundary)}; only stages that pass on the same hidden state are simulated"
            )


def _shapes(metas: tuple) -> list:
    return [tuple(meta.shape) for meta in metas]


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor: this rank's shard
    return local.numel() * local.element_size()
