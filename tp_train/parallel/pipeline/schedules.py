"""The pipeline schedules tp_train offers, all torch's own (`torch.distributed.pipelining`), as one table; the ones
it refuses, each with the one line saying why."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import pipelining


@dataclass(frozen=True)
class Schedule:
    name: str  # what the user writes: pipeline_schedule="1f1b"
    torch_class: type  # the torch schedule that runs it
    virtual: bool  # several stages per rank, at least 2 of them
    placement: str = "loop"  # "loop": rank r runs stages r, r + pp, ...; "v": rank r runs stages r and 2pp - 1 - r
    microbatch_per_stage: bool = False  # needs at least as many microbatches as stages (torch's DualPipeV)


SCHEDULES = {
    schedule.name: schedule
    for schedule in (
        Schedule("gpipe", pipelining.ScheduleGPipe, virtual=False),
        Schedule("1f1b", pipelining.Schedule1F1B, virtual=False),
        Schedule("interleaved_1f1b", pipelining.ScheduleInterleaved1F1B, virtual=True),
        Schedule("looped_bfs", pipelining.ScheduleLoopedBFS, virtual=True),
        Schedule("interleaved_zero_bubble", pipelining.ScheduleInterleavedZeroBubble, virtual=True),
        Schedule("zbv_zero_bubble", pipelining.ScheduleZBVZeroBubble, virtual=True, placement="v"),
        Schedule("dualpipev", pipelining.ScheduleDualPipeV, virtual=True, placement="v", microbatch_per_stage=True),
    )
}

# Exported by torch but refused: each reason is what keeps it from running here.
REFUSED: dict[str, str] = {}


def schedule_named(name: str, virtual_stages: int) -> Schedule:
    """The schedule called `name`, checked against `virtual_stages` (stages per rank); one-line `ValueError` for a
    refused or unknown name, or a stage count the schedule cannot use."""
    key = name.lower().replace("-", "_")
    if key in REFUSED:
        raise ValueError(f"pipeline_schedule={name!r} is refused: it {REFUSED[key]}; use one of {', '.join(SCHEDULES)}")
    if key not in SCHEDULES:
        raise ValueError(f"pipeline_schedule={name!r} is unknown; use one of {', '.join(SCHEDULES)}")
    schedule = SCHEDULES[key]
    if schedule.placement == "v" and virtual_stages != 2:
        raise ValueError(
            f"pipeline_schedule={name!r} places exactly 2 stages per rank in a V: set pipeline_virtual_stages to 2 "
            f"(got {virtual_stages})"
        )
    if schedule.virtual and virtual_stages < 2:
        raise ValueError(
            f"pipeline_schedule={name!r} runs several stages per rank: set pipeline_virtual_stages to 2 or more "
            f"(got {virtual_stages}), or use 'gpipe' or '1f1b'"
        )
    if not schedule.virtual and virtual_stages != 1:
        raise ValueError(
            f"pipeline_schedule={name!r} runs one stage per rank, but pipeline_virtual_stages={virtual_stages}; use "
            f"'interleaved_1f1b' or 'looped_bfs' for virtual stages"
        )
    return schedule
