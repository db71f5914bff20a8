"""What the benchmark measures on one rank: step time, peak tensor memory and the collectives of one step."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.distributed import ProcessGroup
from torch.profiler import ProfilerActivity, profile

from tp_train.parallel.collectives import COLLECTIVE_RANGE
from tp_train.tools.bench.contenders import TrainingStep
from tp_train.tools.step_counts import StepCounts
from tp_train.training.memory import (  # noqa: F401 - the benchmarks' measures, from where training keeps them
    current_memory,
    peak_memory,
    reset_peak_memory,
    return_freed_memory_at_once,
)

# Where a step's thread spends time on tensor-parallel collectives, as the profiler names it: ours eager (issuing
# and waiting, in one range) and the functional collectives that DTensor and compiled code issue and wait on.
COLLECTIVE_EVENTS = {
    COLLECTIVE_RANGE,
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_reduce_",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::wait_tensor",
}


@contextmanager
def intra_op_threads(threads: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def seconds_per_step(step: TrainingStep, steps: int, group: ProcessGroup, device: torch.device) -> float:
    """Wall time of `steps` steps divided by `steps`, the slowest rank of the group's (they start together)."""
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return group_max(time.perf_counter() - start, group, device) / steps


def peak_bytes(step: TrainingStep, device: torch.device) -> int:
    """Peak bytes of live tensors during one step: those that live between steps (parameters, optimizer states)
    plus the largest growth over what was allocated before it while the step runs, from the allocator events
    torch.profiler records on CPU (every allocation and free of a tensor), or CUDA's peak-allocated counter on a
    GPU. Other models alive on the device (the benchmark's other contenders) do not count."""
    resident = step.resident_bytes()
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        return resident + torch.cuda.max_memory_allocated(device) - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        running += event.nbytes()  # negative for a free
        peak = max(peak, running)
    return resident + peak


def collectives_per_step(step: Callable[[], object]) -> int:
    """Collectives one step issues on this rank (`tp_train.tools.step_counts`)."""
    with StepCounts() as counts:
        step()
    return counts.collective_calls


def collective_bytes_per_step(step: Callable[[], object]) -> int:
    """Bytes of the tensors one step hands to collectives on this rank (`tp_train.tools.step_counts`: an
    all-to-all's input, an all-reduce's tensor)."""
    with StepCounts() as counts:
        step()
    return counts.collective_bytes


def collective_seconds(step: TrainingStep) -> tuple[float, float]:
    """(Time one step's thread spends issuing and waiting on tensor-parallel collectives, that step's wall time),
    both from torch.profiler's events of one profiled step (the outermost of nested collective events); what
    overlap with computation hides no longer shows in the first."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        wall = time.perf_counter() - start
    events = [event for event in prof.events() if event.name in COLLECTIVE_EVENTS and not _inside_collective(event)]
    return sum(event.cpu_time_total for event in events) / 1e6, wall


def _inside_collective(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in COLLECTIVE_EVENTS:
            return True
        parent = parent.cpu_parent
    return False


def group_max(value: float, group: ProcessGroup, device: torch.device) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.item()


def group_mean(value: float, group: ProcessGroup, device: torch.device) -> float:
    tensor = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)


def step_profile(step: TrainingStep, device: torch.device, steps: int = 3, top: int = 10) -> dict:
    """Where `steps` steps spend the device's time, per step: busy milliseconds (the kernels' own time summed,
    CUDA's; on CPU the operators' own CPU time, the same code path) and the `top` kernels by that time."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    rows = [
        (event.key, (event.self_device_time_total if cuda else event.self_cpu_time_total) / 1e3 / steps)
        for event in prof.key_averages()
        if not cuda or event.device_type == DeviceType.CUDA
    ]
    rows.sort(key=lambda row: row[1], reverse=True)
    return {
        "busy_ms_per_step": sum(ms for _, ms in rows),
        "top": [{"name": name, "ms_per_step": ms} for name, ms in rows[:top]],
    }


def profile_table(step: TrainingStep, rows: int = 25) -> str:
    """torch.profiler's table of one step's operators, by self CPU time: where the time goes."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)
