"""The time of one training step, predicted from a simulated step's counts (`tp_train.tools.simulate.SimulatedStep`)
and a hardware profile (`tp_train.tools.hardware`):

    step = (compute + exposed communication) x (1 + bubble)

- compute: the step's FLOPs at the profile's rate times its efficiency, plus a fixed cost per dispatched operation
  (what dominates small models: a kernel launch, a CPU op's dispatch);
- communication: each collective priced as its algorithm moves it (a ring's steps and bytes, `wire_bytes`) over the
  links its group spans (within a node, or across nodes); the tensor, context, expert and pipeline parallel ones wait
  in the step's path; the data-parallel ones (gradient all-reduces and reduce-scatters, FSDP2's all-gathers) run beside
  up to `overlap` of the compute;
- the pipeline bubble: a schedule of m microbatches over pp ranks of v stages each idles (pp - 1) / (m v) of its work.
CPU ranks sharing a node's cores run slower by the profile's `slowdown`.
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

# The groups whose collectives reduce gradients or gather parameters, which can run beside the compute.
DATA_PARALLEL_ROLES = frozenset({REPLICAS, DATA_PARALLEL, DATA_REPLICATE, SHARD_GROUP, EXPERT_REPLICAS})


@dataclass(frozen=True)
class StepTime:
    """A predicted step, in seconds: its parts and their sum."""

    compute: float
    communication: float  # what the step waits on
    hidden_communication: float  # what ran beside the compute
    bubble: float

    @property
    def total(self) -> float:
        return self.compute + self.communication + self.bubble


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
    steps: Sequence[SimulatedStep], dims: ParallelDims, profile: HardwareProfile, microbatches: int = 1
) -> StepTime:
    """The step on `profile`'s devices (see the module docstring) of the ranks `steps` simulated: one rank's, or
    under a pipeline one per stage kind (its first and last ranks: the embedding's and the head's). The slowest one's
    work, and a bubble of `bubble_fraction` of the stages' mean work: a rank idles while the others fill and drain
    the pipeline. `microbatches`: the pipeline's, per step."""
    slowdown = profile.slowdown(min(dims.world_size, profile.devices_per_node))
    busy = [_busy(step, profile, slowdown) for step in steps]
    compute, communication, hidden = max(busy, key=lambda parts: parts[0] + parts[1])
    mean_work = sum(parts[0] + parts[1] for parts in busy) / len(busy)
    return StepTime(compute, communication, hidden, mean_work * bubble_fraction(dims, microbatches))


def _busy(step: SimulatedStep, profile: HardwareProfile, slowdown: float) -> tuple[float, float, float]:
    """(compute, communication waited on, communication hidden) of one rank's step, in seconds."""
    compute = step.flops / (profile.flops_per_s * profile.efficiency) + step.operations * profile.operation_s
    compute *= slowdown
    waited = beside = 0.0
    for collective, count in step.collectives.items():
        seconds = collective_seconds(collective, count.calls, count.bytes, profile) * slowdown
        if collective.role in DATA_PARALLEL_ROLES:
            beside += seconds
        else:
            waited += seconds
    hidden = min(beside, profile.overlap * compute)
    return compute, waited + beside - hidden, hidden
