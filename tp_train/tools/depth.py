"""A deep model's simulated step from two shallow ones: the model built with two and with three blocks per pipeline
stage, each simulated (`simulate_step`), and every count (each kind of memory at the peak, FLOPs, operations, bytes
moved, each collective's calls and bytes) carried on along the line through the two to the real blocks per stage.

A simulation's time grows with the blocks it runs, so a 70B-class model on hundreds of devices is not simulated whole
(`tp-train-plan`). The line is exact where a stage's blocks are alike and each adds the same: its parameters,
gradients and optimizer states, its activations kept for the backward, its FLOPs and collectives. What a stage holds
once (the embedding, the head and loss, the backward's temporaries of one block) is the line's constant. Two blocks,
not one, begin the line: a stage's only block is also its last, which FSDP2 keeps gathered after the forward (one
block's working memory then grows by 1.12x the next block's at the GPT of `tests/test_depth.py`; from two on, each
adds the same). Stated
assumptions: the blocks are identical (a model whose first blocks differ, DeepSeek's dense ones before its experts',
is extrapolated from those first blocks). The shallow builds split two and three blocks to a stage; the rank's real
count comes from the deep model's split, weighed from a one-block build on the meta device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from functools import partial

import torch
import torch.nn as nn

from tp_train.parallel.dims import ParallelDims
from tp_train.tools.pipeline_memory import rank_stages
from tp_train.tools.simulate import SimulatedMemory, SimulatedStep, simulate_step
from tp_train.tools.step_counts import CollectiveCount
from tp_train.training.apply_order import TrainingOptions
from tp_train.training.pipeline_split import balanced_sizes, stage_weights


@dataclass(frozen=True)
class Depth:
    """A model that can be built at any number of its repeated blocks (`build(blocks)`), and the number it has."""

    build: Callable[[int], nn.Module]
    blocks: int
    where: str = "the model"  # for a refusal's message: which model and list

    def __post_init__(self) -> None:
        if self.blocks < 1:
            raise ValueError(f"Depth: blocks={self.blocks}; a model has at least one block")


def simulate_at_depth(
    depth: Depth, dims: ParallelDims, forward_backward, options: TrainingOptions | None = None, rank: int = 0
) -> SimulatedStep:
    """`simulate_step` of the model at `depth.blocks` blocks: simulated whole when each of the rank's stages holds at
    most three, else from builds of two and of three blocks a stage (see the module docstring), carried on to the blocks
    the rank's stages hold in the model's real split (`options.pipeline_split`, else balanced by parameters as the
    pipeline balances them). The stages are checked against the real blocks first (a ValueError, as `simulate_step`'s
    for a model the degrees cannot shard)."""
    options = options or TrainingOptions()
    dims.check_blocks(depth.blocks, depth.where)
    held = _blocks_a_stage(depth, dims, options.pipeline_split, options.pipeline_schedule, rank)
    if held <= 3:
        return simulate_step(partial(depth.build, depth.blocks), dims, forward_backward, options, rank)
    one, two = (
        simulate_step(
            partial(depth.build, dims.stages * k), dims, forward_backward,
            replace(options, pipeline_split=(k,) * dims.stages if dims.pp > 1 else None), rank,
        )
        for k in (2, 3)
    )  # fmt: skip
    return along_the_line(one, two, held - 2)


def _blocks_a_stage(depth: Depth, dims: ParallelDims, explicit, schedule: str, rank: int) -> int:
    """The blocks each pipeline stage of `rank` holds (the same in each of its stages: `check_blocks`); all of them
    without a pipeline."""
    if dims.pp == 1:
        return depth.blocks
    if explicit is None:
        explicit = _balanced_split(depth, dims.stages)
    stages = rank_stages(schedule, dims.stages, dims.pp, dims.pipeline_rank(rank), dims.virtual_stages)
    return max(explicit[stage] for stage in stages)


def along_the_line(first: SimulatedStep, second: SimulatedStep, steps: float) -> SimulatedStep:
    """`first + steps * (second - first)`, count by count (rounded to whole bytes, operations and calls): the step of
    a stage with `steps` more blocks than `first`'s when `second` has one more."""

    def at(a: float, b: float) -> int:
        return max(0, round(a + steps * (b - a)))

    memory = SimulatedMemory(
        **{f.name: at(getattr(first.memory, f.name), getattr(second.memory, f.name)) for f in fields(SimulatedMemory)}
    )
    collectives = {}
    for key in first.collectives.keys() | second.collectives.keys():
        a, b = first.collectives.get(key, CollectiveCount()), second.collectives.get(key, CollectiveCount())
        collectives[key] = CollectiveCount(at(a.calls, b.calls), at(a.bytes, b.bytes))
    return replace(
        first,
        memory=memory,
        flops=at(first.flops, second.flops),
        operations=at(first.operations, second.operations),
        memory_traffic=at(first.memory_traffic, second.memory_traffic),
        collectives=collectives,
    )


@functools.lru_cache(maxsize=64)
def _balanced_split(depth: Depth, stages: int) -> tuple[int, ...]:
    """The deep model's blocks per stage as the pipeline balances them, weighed from a one-block build on the meta
    device (once per model and stage count: the chooser asks for every layout)."""
    with torch.device("meta"):
        weights, first, last = stage_weights(depth.build(1))
    return tuple(balanced_sizes(weights * depth.blocks, first, last, stages))
