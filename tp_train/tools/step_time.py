"""The time of one optimizer step, predicted from a simulated step's counts (`tp_train.tools.simulate.SimulatedStep`)
and a hardware profile (`tp_train.tools.hardware`). Each rank's work on one micro-batch:

- compute: its FLOPs at the profile's rate times its efficiency, the bytes its other operations read and write at
  the memory's bandwidth, plus a fixed cost per dispatched operation (what dominates small models: a kernel launch,
  a CPU op's dispatch);
- communication: each collective priced as its algorithm moves it (a ring's steps and bytes, `wire_bytes`) over the
  links its group spans (within a node, or across nodes); the tensor, context, expert and pipeline parallel ones are
  waited on; the data-parallel ones (gradient all-reduces and reduce-scatters, FSDP2's all-gathers) run beside up to
  `overlap` of the compute, except under a pipeline, which averages its stages' gradients after its schedule.

With `accumulation` micro-batches a step, each is computed, but the gradients are reduced once (the micro-batches
before the last accumulate inside `no_sync`). The step is then the slowest simulated rank's work plus the pipeline
bubble, (pp - 1) / (m v) of the stages' mean work (m microbatches, v stages a rank: the others fill and drain the
pipeline meanwhile). CPU ranks split a node's cores into intra-op threads (`HardwareProfile.thread_speed`); ranks
beyond the cores share them, so the step takes at least every rank's work over the cores (`sharing`: a rank that waits
in the bubble leaves its core to the others).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.mesh import DATA_PARALLEL, DATA_REPLICATE, EXPERT_REPLICAS, REPLICAS, SHARD_GROUP
from tp_train.tools.hardware import HardwareProfile
from tp_train.tools.simulate import SimulatedStep
from tp_train.tools.step_counts import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BROADCAST,
    POINT_TO_POINT,
    REDUCE_SCATTER,
    Collective,
)

# The groups whose collectives reduce gradients or gather parameters, which can run beside the compute; their
# gradient reductions run once an optimizer step however many micro-batches it accumulates.
DATA_PARALLEL_ROLES = frozenset({REPLICAS, DATA_PARALLEL, DATA_REPLICATE, SHARD_GROUP, EXPERT_REPLICAS})
GRADIENT_REDUCTIONS = frozenset({ALL_REDUCE, REDUCE_SCATTER})


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds: its parts and their sum."""

    compute: float
    communication: float  # what the step waits on
    hidden_communication: float  # what ran beside the compute
    bubble: float
    sharing: float = 0.0  # CPU ranks beyond the cores: the wait for a core, past the rest

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble + self.sharing


def wire_bytes(kind: str, ranks: int, tensor_bytes: int) -> float:
    """The bytes each rank sends for one collective of a `tensor_bytes` tensor (`step_counts`' bytes) over `ranks`,
    by a ring (NCCL's and gloo's large-message algorithm)."""
    share = (ranks - 1) / ranks
    if kind == ALL_REDUCE:
        return 2 * share * tensor_bytes  # a reduce-scatter, then an all-gather
    if kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL):
        return share * tensor_bytes
    return float(tensor_bytes)  # a broadcast's pipelined chain, a point-to-point message


def ring_steps(kind: str, ranks: int) -> int:
    """The latency-bound hops of one collective over `ranks`."""
    if kind == ALL_REDUCE:
        return 2 * (ranks - 1)
    if kind in (ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST):
        return ranks - 1
    return 1 if kind == POINT_TO_POINT else ranks - 1


def collective_seconds(collective: Collective, calls: int, tensor_bytes: int, profile: HardwareProfile) -> float:
    """The time `calls` of one collective take, all `tensor_bytes` of them, over the links its ranks span."""
    ranks = len(collective.ranks)
    nodes = {rank // profile.devices_per_node for rank in collective.ranks}
    bandwidth = profile.inter_node_bytes_per_s if len(nodes) > 1 else profile.intra_node_bytes_per_s
    hops = calls * ring_steps(collective.kind, ranks) if collective.kind != POINT_TO_POINT else calls
    return hops * profile.latency_s + wire_bytes(collective.kind, ranks, tensor_bytes) / bandwidth


def bubble_fraction(dims: ParallelDims, microbatches: int) -> float:
    """The idle share of a pipeline rank's work: (pp - 1) / (microbatches x virtual stages); 0 without a pipeline."""
    return (dims.pp - 1) / (microbatches * dims.virtual_stages) if dims.pp > 1 else 0.0


def predict_step_time(
    steps: Sequence[SimulatedStep],
    dims: ParallelDims,
    profile: HardwareProfile,
    microbatches: int = 1,
    accumulation: int = 1,
) -> StepTime:
    """The optimizer step (see the module docstring) of the ranks `steps` simulated, on `profile`'s devices: one
    rank's, or under a pipeline one per stage kind (its first and last ranks: the embedding's and the head's), each a
    step of one micro-batch. `microbatches`: the pipeline's per micro-batch; `accumulation`: micro-batches a step."""
    ranks_on_node = min(dims.world_size, profile.devices_per_node)
    speed = profile.thread_speed(ranks_on_node)
    work = [_work(step, dims, profile, accumulation, speed) for step in steps]
    compute, communication, hidden = max(work, key=lambda parts: parts[0] + parts[1])
    mean_work = sum(parts[0] + parts[1] for parts in work) / len(work)
    bubble = mean_work * bubble_fraction(dims, microbatches)
    sharing = 0.0
    if profile.cores is not None and ranks_on_node > profile.cores:
        sharing = max(0.0, ranks_on_node * mean_work / profile.cores - (compute + communication + bubble))
    return StepTime(compute, communication, hidden, bubble, sharing)


def _work(step, dims, profile, accumulation, speed) -> tuple[float, float, float]:
    """(compute, communication waited on, communication hidden) of one rank's optimizer step, in seconds."""
    compute = step.flops / (profile.flops_per_s * profile.efficiency) + step.operations * profile.operation_s
    compute += step.memory_traffic / profile.memory_bytes_per_s
    compute *= accumulation / speed
    waited = beside = 0.0
    for collective, count in step.collectives.items():
        reduced_once = collective.role in DATA_PARALLEL_ROLES and collective.kind in GRADIENT_REDUCTIONS
        calls = 1 if reduced_once else accumulation
        seconds = calls * collective_seconds(collective, count.calls, count.bytes, profile) / speed
        if collective.role in DATA_PARALLEL_ROLES and dims.pp == 1:
            beside += seconds
        else:
            waited += seconds
    hidden = min(beside, profile.overlap * compute)
    return compute, waited + beside - hidden, hidden
