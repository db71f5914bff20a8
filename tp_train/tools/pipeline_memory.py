"""What a pipeline rank holds, for `estimate_memory`: the parameters of its stages, and how many microbatches'
activations its schedule keeps in flight at once.

In flight, per torch's schedules (`torch.distributed.pipelining`), on group rank r of p with m microbatches and v
stages per rank, in microbatches of the rank's whole share of blocks:
- GPipe and LoopedBFS run every forward before any backward: m.
- 1F1B runs p - r forwards before its first backward, then one forward per backward: min(m, p - r).
- Interleaved1F1B warms up with (v - 1) p + 2 (p - 1 - r) chunks, each one stage's (1/v of the rank's blocks), then
  one forward per backward: min(that + 1, m v) / v.
- The zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) also keep the inputs of each deferred
  weight gradient; they are counted as m, the most any schedule holds (an upper bound).
"""

from __future__ import annotations

import torch.nn as nn

from tp_train.parallel.pipeline.schedules import schedule_named
from tp_train.parallel.pipeline.split import PipelineSplit


def in_flight(schedule: str, pp: int, rank: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Microbatches of activations pipeline rank `rank` holds at once (see the module docstring)."""
    key = schedule_named(schedule, virtual_stages).name
    if key == "1f1b":
        return min(microbatches, pp - rank)
    if key == "interleaved_1f1b":
        warmup = (virtual_stages - 1) * pp + 2 * (pp - 1 - rank)
        return min(warmup + 1, microbatches * virtual_stages) / virtual_stages
    return microbatches


def rank_stages(schedule: str, num_stages: int, pp: int, rank: int, virtual_stages: int) -> list[int]:
    """The stages pipeline rank `rank` runs: r, r + p, ... (looped), or r and 2p - 1 - r (a V)."""
    if schedule_named(schedule, virtual_stages).placement == "v":
        return [rank, num_stages - 1 - rank]
    return list(range(rank, num_stages, pp))


def rank_parameter_ids(model: nn.Module, split: PipelineSplit, stages: list[int]) -> set[int]:
    """id() of each parameter the stages hold (a parameter tied across stages counts on each rank holding it)."""
    return {
        id(param)
        for stage in stages
        for name in split.stage_modules(stage)
        for param in model.get_submodule(name).parameters()
    }
