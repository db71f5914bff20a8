"""One benchmark run: every rank of one world runs this; rank 0 collects the results."""

from __future__ import annotations

import gc
import math
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from models import GPT
from tp_train.tools.bench.contenders import Contender, Size, build
from tp_train.tools.bench.measure import (
    collective_seconds,
    collectives_per_step,
    group_max,
    group_mean,
    intra_op_threads,
    peak_bytes,
    profile_table,
    seconds_per_step,
)
from tp_train.tools.memory import MIB, estimate_memory, tensor_parallel_bytes_per_step


def contenders_for(size: Size, tps: list[int], largest: bool, compiled: bool = True) -> list[Contender]:
    contenders = [Contender("plain", 1)]
    for tp in tps:
        contenders += [Contender("ours", tp), Contender("native", tp)]
        if tp <= 2:  # what the same bits at every degree cost (docs/invariant-numerics.md)
            contenders.append(Contender("ours", tp, numerics="invariant"))
        if compiled and tp > 1:
            contenders += [Contender("ours", tp, compiled=True), Contender("native", tp, compiled=True)]
        if tp == 2:  # what overlap gains, and what sequence parallelism and activation checkpointing save and cost
            contenders += [
                Contender("ours", tp, overlap=False),
                Contender("ours", tp, sequence_parallel=True),
                Contender("ours", tp, activation_checkpointing=True),
            ]
    if largest and 2 in tps:  # does splitting over two one-thread ranks beat one two-thread process?
        contenders.append(Contender("plain", 1, threads=2))
    return contenders


def benchmark(
    rank: int,
    sizes: list[Size],
    tps: list[int],
    repeats: int,
    seconds: float,
    device: torch.device,
    profile_dir: Path | None = None,
    compiled: bool = True,
):
    """Runs every size; returns the results on rank 0 (None elsewhere). With `profile_dir`, rank 0 also writes
    a profiler table of one step of every contender there. `compiled` adds ours and native under torch.compile
    at every tp above one (each compiles on its first steps, before any timing)."""
    groups = {tp: dist.new_group(list(range(tp))) for tp in sorted(set(tps) | {1})}
    results = []
    for index, size in enumerate(sizes):
        contenders = contenders_for(size, tps, largest=index == len(sizes) - 1, compiled=compiled)
        mine = [c for c in contenders if rank < c.tp]
        steps = {c: build(c, size, groups[c.tp], device) for c in mine}
        for contender in contenders:  # compile (forward and backward graphs) before anything is timed
            dist.barrier()
            if contender.compiled and contender in steps:
                for _ in range(2):
                    steps[contender]()
        with torch.device("meta"):
            meta_model = GPT(size.config())
        warmup = {}
        for contender in contenders:  # also the step count: enough steps for about `seconds` per timing
            dist.barrier()
            if contender in steps:
                with intra_op_threads(contender.threads):
                    warmup[contender] = seconds_per_step(steps[contender], 1, groups[contender.tp], device)
        slowest = group_max(max(warmup.values()) if warmup else 0.0, dist.group.WORLD, device)
        per_timing = max(1, math.ceil(seconds / slowest))
        times = {c: [] for c in contenders}
        for repeat in range(repeats):
            shift = repeat % len(contenders)
            for contender in contenders[shift:] + contenders[:shift]:
                dist.barrier()
                if contender in steps:
                    with intra_op_threads(contender.threads):
                        times[contender].append(
                            seconds_per_step(steps[contender], per_timing, groups[contender.tp], device)
                        )
        rows = {}
        for contender in contenders:
            dist.barrier()
            if contender not in steps:
                continue
            step, group = steps[contender], groups[contender.tp]
            counter = getattr(step.model, "tp_comm_counter", None)
            if counter is not None:
                counter.reset()
            collectives = collectives_per_step(step)
            counted_bytes = counter.bytes if counter is not None else None  # of that one step
            profiled = [collective_seconds(step) for _ in range(3)]  # (in collectives, whole step), profiled
            collective_s = group_mean(statistics.median(c for c, _ in profiled), group, device)
            collective_share = group_mean(statistics.median(c / wall for c, wall in profiled), group, device)
            memory = dict(
                sequence_parallel=contender.sequence_parallel,
                activation_checkpointing=contender.activation_checkpointing,
            )
            estimate = estimate_memory(
                meta_model, size.batch, size.seq, contender.tp, **memory, loss_parallel=contender.kind == "ours"
            )
            row = {
                "kind": contender.kind,
                "tp": contender.tp,
                "threads": contender.threads,
                "step_s": statistics.median(times[contender]),
                "step_s_repeats": times[contender],
                "step_s_min": min(times[contender]),
                "tokens_per_s": size.batch * size.seq / statistics.median(times[contender]),
                # The median of three steps: now and then one step measures ~10% higher, when an allocation on a
                # second thread (seen with gloo ranks) overlaps the peak.
                "peak_mib": group_max(statistics.median(peak_bytes(step, device) for _ in range(3)), group, device)
                / MIB,
                "model_state_mib": group_max(step.model_state_bytes(), group, device) / MIB,
                "predicted_peak_mib": estimate.total / MIB,
                "variant": contender.variant,
                "collectives_per_step": collectives,
                "collective_s": collective_s,
                "collective_share": collective_share,  # of the profiled step's wall time
                "compiled": contender.compiled,
                "numerics": contender.numerics,
            }
            if contender.kind == "ours":
                row["tp_bytes_per_step"] = counted_bytes
                row["analytic_tp_bytes_per_step"] = tensor_parallel_bytes_per_step(
                    meta_model, size.batch, size.seq, contender.tp, **memory, loss_parallel=True
                )
            rows[contender.name] = row
            if profile_dir is not None:
                table = profile_table(step)
                if rank == 0:
                    (profile_dir / f"{size.name}-{contender.name.replace(' ', '_')}.txt").write_text(table)
        results.append({"size": asdict(size), "steps_per_timing": per_timing, "contenders": rows})
        del steps
        gc.collect()
    return results if rank == 0 else None
