"""Choosing the degrees: every valid layout of a world size simulated (`simulate_step`), those over the memory
dropped, the rest ranked by their predicted step time (`tp_train.tools.step_time`).

A layout is the degrees (tp, pp, dp; the data-parallel mode: DDP, FSDP2 over all of dp, or HSDP's shard groups of
each size that divides dp and stays within a node), the pipeline's schedule, activation checkpointing, and
how each data-parallel rank's share of the global batch is cut: micro-batches accumulated, each split into the
pipeline's microbatches. The global batch (sequences per optimizer step) is held fixed. For each set of degrees,
schedule and mode, the cheapest way to fit is searched in order: the whole share at once, then with activation
checkpointing, then accumulated over 2, 4, ... micro-batches (each again without, then with, checkpointing); the
first that fits is that layout's (found by bisection: memory falls with the micro-batch), and a set that fits in
none is reported with its smallest need.

Not chosen yet (pinned at 1): context and expert parallelism (their steps are not simulated: a sequence's shares,
data-dependent routing).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn as nn

from tp_train.parallel.dims import ParallelDims
from tp_train.tools.depth import Depth, simulate_at_depth
from tp_train.tools.hardware import GIB, HardwareProfile
from tp_train.tools.memory import MIB
from tp_train.tools.simulate import SimulatedStep, simulate_step
from tp_train.tools.step_time import StepTime, predict_step_time
from tp_train.tools.steps import language_model_step
from tp_train.training.apply_order import TrainingOptions

HEADROOM = 0.10  # of a device's memory kept free: the allocator's fragmentation, the runtime's own buffers
DEGREES = ("tp", "pp", "dp", "dp_shard")
SCHEDULES = (("1f1b", 1), ("interleaved_1f1b", 2))  # (schedule, stages per pipeline rank) tried under a pipeline


@dataclass(frozen=True)
class Layout:
    """One way to train: the degrees, how each is applied, and how the global batch is cut."""

    dims: ParallelDims
    options: TrainingOptions
    micro_batch: int  # sequences a data-parallel rank runs at once
    accumulation: int  # micro-batches per optimizer step
    microbatches: int  # the pipeline's, per micro-batch (1 without a pipeline)

    def label(self) -> str:
        dims, options = self.dims, self.options
        parts = [f"tp={dims.tp}", f"pp={dims.pp}", f"dp={dims.dp}"]
        if dims.dp > 1:
            parts.append(f"hsdp x{dims.dp_shard}" if dims.data_parallel == "hsdp" else options.data_parallel)
        if dims.pp > 1:
            parts.append(f"{options.pipeline_schedule} x{self.microbatches}")
        if options.activation_checkpointing:
            parts.append("ac")
        if self.accumulation > 1:
            parts.append(f"accumulate {self.accumulation}")
        return " ".join(parts)


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: int  # the peak bytes of its fullest simulated rank
    time: StepTime | None  # of one optimizer step (every micro-batch); None where it does not fit
    tokens_per_s: float
    fits: bool
    unshardable: str | None = None  # why the model cannot take these degrees (then no memory is known)


def choose_layout(
    build: Callable[[], nn.Module] | Depth,
    world_size: int,
    global_batch: int,
    seq_len: int,
    vocab_size: int,
    memory_per_device: float,
    profile: HardwareProfile,
    pinned: dict[str, int | str] | None = None,
    options: TrainingOptions | None = None,
    autocast: torch.dtype | None = None,
    num_nodes: int = 1,
) -> list[Candidate]:
    """Every layout of `world_size` ranks training `build()`'s model on `global_batch` sequences of `seq_len` tokens
    per optimizer step: those that fit `memory_per_device` bytes (less `HEADROOM`) first, fastest first (predicted on
    `profile`), then those that do not, smallest first. A `Depth` for `build` simulates a deep model from shallow
    builds of it (`tp_train.tools.depth`). `pinned` fixes degrees ("tp", "pp", "dp",
    "dp_shard") or "data_parallel" (dp per node, as the config gives it); `options` gives the rest of the strategy's
    settings (the loss, sequence parallelism). Over `num_nodes` nodes (the world split evenly), each node holds the
    same number of data-parallel ranks, and a group spanning nodes is priced at the profile's inter-node bandwidth."""
    pinned = dict(pinned or {})
    unknown = sorted(set(pinned) - {*DEGREES, "data_parallel"})
    if unknown:
        raise ValueError(
            f"choose_layout: cannot pin {', '.join(unknown)}; pin one of {', '.join(DEGREES)}, data_parallel"
        )
    if "dp_shard" in pinned and pinned.get("data_parallel", "fsdp") != "fsdp":
        raise ValueError(
            f"choose_layout: dp_shard={pinned['dp_shard']} shards over groups of FSDP2 ranks (HSDP), which "
            f"data_parallel={pinned['data_parallel']} does not; pin data_parallel=fsdp, or leave dp_shard out"
        )
    budget = memory_per_device * (1 - HEADROOM)
    profile = replace(profile, devices_per_node=ParallelDims.ranks_per_node(world_size, num_nodes))
    base = replace(options or TrainingOptions(loss_parallel=True), verify_plan=False)
    candidates = []
    for dims, applied in _degrees(world_size, num_nodes, global_batch, pinned, base):
        candidates.append(_fit(build, dims, applied, global_batch, seq_len, vocab_size, budget, profile, autocast))
    if not candidates:
        raise ValueError(
            f"choose_layout: no layout of {world_size} ranks has {_pins(pinned)} and takes a global batch of "
            f"{global_batch}; pin degrees whose product divides {world_size}, leaving a data-parallel size that "
            f"divides the global batch"
        )
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: c.time.total)
    over = sorted((c for c in candidates if not c.fits and not c.unshardable), key=lambda c: c.memory)
    return fitting + over + [c for c in candidates if c.unshardable]


def _pins(pinned: dict) -> str:
    return ", ".join(f"{key}={value}" for key, value in pinned.items()) or "no degree pinned"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _degrees(world_size, num_nodes, global_batch, pinned, base) -> Iterator[tuple[ParallelDims, TrainingOptions]]:
    """Each valid (degrees, schedule, data-parallel mode) of the world, as pinned; the same data-parallel ranks on
    each node."""
    for tp, pp in itertools.product(_divisors(world_size), repeat=2):
        filled = _valid(ParallelDims.from_world(world_size, tp=tp, pp=pp))
        per_node = filled.dp_per_node(num_nodes) if filled is not None else None
        if per_node is None:  # tp x pp does not divide the world, or dp the nodes
            continue
        chosen = {"tp": tp, "pp": pp, "dp": per_node}
        if any(pinned.get(key, value) != value for key, value in chosen.items()) or global_batch % filled.dp:
            continue
        modes = ("fsdp",) if "dp_shard" in pinned else ("ddp", "fsdp") if filled.dp > 1 else ("ddp",)
        for mode in [pinned["data_parallel"]] if "data_parallel" in pinned else modes:
            for shard in _shard_sizes(filled.dp, mode, pinned):
                for schedule, virtual in SCHEDULES if pp > 1 else (("1f1b", 1),):
                    made = ParallelDims.from_world(
                        world_size, tp=tp, pp=pp, data_parallel=mode, dp_shard=shard, virtual_stages=virtual
                    )
                    dims = _valid(made, num_nodes)
                    if dims is not None:
                        yield dims, replace(base, data_parallel=mode, pipeline_schedule=schedule)


def _shard_sizes(dp: int, mode: str, pinned: dict) -> list[int | None]:
    """FSDP2's shard group sizes to try: all of dp (None), and HSDP's groups of each divisor of dp between (whole
    copies across the groups); DDP shards nothing. A pinned `dp_shard` is the one tried."""
    if mode != "fsdp":
        return [None]
    if "dp_shard" in pinned:
        return [None if pinned["dp_shard"] == dp else pinned["dp_shard"]]
    return [None, *(size for size in _divisors(dp) if 1 < size < dp)]


def _valid(dims: ParallelDims, num_nodes: int = 1) -> ParallelDims | None:
    try:
        dims.validate(num_nodes=num_nodes)
    except ValueError:
        return None
    return dims


def _fit(build, dims, options, global_batch, seq_len, vocab_size, budget, profile, autocast) -> Candidate:
    """The first way of cutting this layout's share of the batch that fits, in the order of the module docstring, or
    its smallest need. Memory falls as the micro-batch shrinks and with checkpointing, so after the whole share
    (without, then with checkpointing) the order's first fit is found by bisection: the smallest micro-batch with
    checkpointing (when even it does not fit, nothing does), then the largest micro-batch that fits with
    checkpointing, then that one without it."""
    share = global_batch // dims.dp
    cuts = [(share // n, n) for n in _divisors(share) if _pipeline_microbatches(dims, share // n) is not None]
    if not cuts:  # no micro-batch of the share splits into the pipeline's microbatches
        reason = f"no micro-batch of {share} sequences a rank divides into {dims.stages} pipeline stages"
        return Candidate(Layout(dims, options, share, 1, dims.stages), 0, None, 0.0, fits=False, unshardable=reason)

    def tried(index: int, checkpointing: bool) -> Candidate:
        micro_batch, accumulation = cuts[index]
        microbatches = _pipeline_microbatches(dims, micro_batch)
        applied = replace(
            options, activation_checkpointing=checkpointing,
            pipeline_microbatches=microbatches if dims.pp > 1 else None,
        )  # fmt: skip
        layout = Layout(dims, applied, micro_batch, accumulation, microbatches)
        steps = simulated_ranks(build, layout, seq_len, vocab_size, autocast)
        memory = max(step.memory.peak for step in steps)
        if memory > budget:
            return Candidate(layout, memory, None, 0.0, fits=False)
        time = predict_step_time(steps, dims, profile, microbatches, accumulation)
        return Candidate(layout, memory, time, global_batch * seq_len / time.total, fits=True)

    try:
        for checkpointing in (False, True):  # the whole share at once: where memory is plenty, the only try
            whole = tried(0, checkpointing)
            if whole.fits:
                return whole
        smallest = tried(len(cuts) - 1, True) if len(cuts) > 1 else whole
        if not smallest.fits:
            return smallest
        low, high, best = 1, len(cuts) - 1, smallest  # cuts[high] fits with checkpointing; find the first that does
        while low < high:
            middle = (low + high) // 2
            candidate = tried(middle, True)
            if candidate.fits:
                high, best = middle, candidate
            else:
                low = middle + 1
        without = tried(high, False)
    except ValueError as error:  # a model these degrees cannot shard (heads tp does not divide, too few blocks)
        layout = Layout(dims, options, share, 1, _pipeline_microbatches(dims, share) or dims.stages)
        return Candidate(layout, 0, None, 0.0, fits=False, unshardable=str(error))
    return without if without.fits else best


def _pipeline_microbatches(dims: ParallelDims, micro_batch: int) -> int | None:
    """The pipeline's microbatches for a micro-batch: twice the stages when they divide it (a smaller bubble), else
    the stages; None when neither does. 1 without a pipeline."""
    if dims.pp == 1:
        return 1
    return next((m for m in (2 * dims.stages, dims.stages) if micro_batch % m == 0), None)


def simulated_ranks(build, layout: Layout, seq_len, vocab_size, autocast=None) -> tuple[SimulatedStep, ...]:
    """One micro-batch's step of the layout's first rank and, under a pipeline, of its last (the head's stage): the
    ranks `predict_step_time` takes."""
    dims = layout.dims
    step = language_model_step(layout.micro_batch, seq_len, vocab_size, autocast=autocast)
    ranks = [0] if dims.pp == 1 else [0, dims.world_size - 1]
    simulate = partial(simulate_at_depth, build) if isinstance(build, Depth) else partial(simulate_step, build)
    return tuple(simulate(dims, step, layout.options, rank=rank) for rank in ranks)


def table(candidates: list[Candidate], memory_per_device: float, rows: int = 5) -> str:
    """The best `rows` layouts, then one line per layout that lost, saying why."""
    lines = [f"{'layout':<44} {'memory/rank':>11} {'step':>9} {'tokens/s':>10}"]
    fitting = [c for c in candidates if c.fits]
    for candidate in fitting[:rows]:
        lines.append(
            f"{candidate.layout.label():<44} {size_label(candidate.memory):>11} {candidate.time.total:8.3f}s "
            f"{candidate.tokens_per_s:10.0f}"
        )
    slower = fitting[rows:]
    if slower:
        lines.append(f"slower: {', '.join(c.layout.label() for c in slower)}")
    usable = size_label(memory_per_device * (1 - HEADROOM))
    for candidate in (c for c in candidates if not c.fits):
        if candidate.unshardable:
            lines.append(f"cannot shard this model: {candidate.layout.label()} ({candidate.unshardable})")
        else:
            need = f"needs {size_label(candidate.memory)}, {usable} usable"
            lines.append(f"over the memory: {candidate.layout.label()} ({need})")
    return "\n".join(lines)


def size_label(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:.1f} MiB"
