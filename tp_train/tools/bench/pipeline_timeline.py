"""Each pipeline rank's own timeline of stage work, and what a schedule's shape alone would idle: the pipeline
benchmark's measuring tools (`tp_train.tools.bench.pipeline`)."""

from __future__ import annotations

import statistics
import time

from tp_train.parallel.pipeline import Pipeline, TokenWeightedCrossEntropy

# A stage's chunk methods that torch's schedules call for the stage's work; each is timed on its own
STAGE_WORK = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
# torch's action letters the simulation follows -> the chunk method that runs them ("B": the full backward)
ACTION_WORK = {"F": "forward_one_chunk", "B": "backward_one_chunk"}


class Timeline:
    """The (start, end, what) of each piece of stage work this rank runs, `what` being (chunk method or "loss",
    stage index), timed by wrapping its stages' chunk methods (instance attributes: torch's classes are left as
    they are) and the loss."""

    def __init__(self) -> None:
        self.intervals: list[tuple[float, float, tuple[str, int]]] = []

    def timed(self, fn, what: tuple[str, int]):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.intervals.append((start, time.perf_counter(), what))

        return run

    def watch(self, pipeline: Pipeline) -> None:
        for stage in pipeline.stages:
            for name in STAGE_WORK:
                setattr(stage, name, self.timed(getattr(stage, name), (name, stage.stage_index)))

    def busy(self, start: float, end: float) -> float:
        return sum(min(b, end) - max(a, start) for a, b, _ in self.intervals if b > start and a < end)

    def mean_durations(self, since: float) -> dict[tuple[str, int], float]:
        """The mean seconds of each kind of work (chunk method or loss, stage) that started after `since`."""
        seen: dict[tuple[str, int], list[float]] = {}
        for start, end, what in self.intervals:
            if start >= since:
                seen.setdefault(what, []).append(end - start)
        return {what: statistics.mean(values) for what, values in seen.items()}


class TimedLoss(TokenWeightedCrossEntropy):
    def __init__(self, timeline: Timeline, last_stage: int) -> None:
        super().__init__()
        self.timeline, self.last_stage = timeline, last_stage

    def __call__(self, logits, target):
        return self.timeline.timed(super().__call__, ("loss", self.last_stage))(logits, target)


def schedule_table_bubble(torch_schedule) -> float | None:
    """The bubble of torch's own action table for a schedule with several stages per rank (its `pipeline_order`:
    each rank's actions in time slots, None where it waits), every action one slot: the ranks' mean of (slots of
    the longest rank's table - the rank's actions) / its actions."""
    order = getattr(torch_schedule, "pipeline_order", None)
    if not order:
        return None
    makespan = max(len(actions) for actions in order.values())
    busy = [sum(action is not None for action in actions) for actions in order.values()]
    return statistics.mean((makespan - done) / done for done in busy)


def simulated_bubble(torch_schedule, durations: dict[tuple[str, int], float], num_stages: int) -> float | None:
    """The bubble torch's action table (`pipeline_order`) would have with each chunk taking its measured mean time
    (`durations`, from every rank's `Timeline.mean_durations`) and communication free: each rank runs its actions
    in the table's order, a forward once the previous stage's forward of that microbatch is done, a backward once
    the next stage's. The ranks' mean of (the step's makespan - the rank's work) / its work, as measured; what the
    measured bubble has above it is the sends, receives and the schedule's own work between chunks. None for a
    table with actions other than forwards and full backwards (the zero-bubble schedules' split backward)."""
    order = getattr(torch_schedule, "pipeline_order", None)
    if not order:
        return None
    every_action = [action for actions in order.values() for action in actions if action is not None]
    if any(action.computation_type.value not in ACTION_WORK for action in every_action):
        return None

    def cost(action) -> float:
        kind, stage = action.computation_type.value, action.stage_index
        seconds = durations[(ACTION_WORK[kind], stage)]
        return seconds + durations.get(("loss", stage), 0.0) if kind == "F" else seconds

    def waits_for(action) -> tuple[str, int, int] | None:
        kind, stage, micro = action.computation_type.value, action.stage_index, action.microbatch_index
        if kind == "F":
            return ("F", stage - 1, micro) if stage > 0 else None
        return ("B", stage + 1, micro) if stage < num_stages - 1 else None

    queues = {rank: [action for action in actions if action is not None] for rank, actions in order.items()}
    done: dict[tuple[str, int, int], float] = {}
    clock, work = dict.fromkeys(queues, 0.0), dict.fromkeys(queues, 0.0)
    moved = True
    while moved:
        moved = False
        for rank, queue in queues.items():
            while queue:
                action = queue[0]
                needed = waits_for(action)
                if needed is not None and needed not in done:
                    break
                clock[rank] = max(clock[rank], done[needed] if needed else 0.0) + cost(action)
                work[rank] += cost(action)
                done[(action.computation_type.value, action.stage_index, action.microbatch_index)] = clock[rank]
                queue.pop(0)
                moved = True
    if any(queues.values()):  # an order this simulation cannot follow
        return None
    makespan = max(clock.values())
    return statistics.mean((makespan - busy) / busy for busy in work.values())
