"""`python -m tp_train.tools.bench.pipeline`: pipeline parallelism's bubble, tokens/s and peak memory per rank for
our GPT at pp = 1, 2 and 4 with each schedule, on one machine's ranks. Prints one table, writes JSON and an SVG plot.

The bubble is measured, not modelled: each rank times its own stages' work in the step (every forward and backward
chunk the schedule runs on it, and the loss on the last stage) and calls the rest of the step's wall time idle:
waiting for a neighbour's activations or gradients, sends and receives, the schedule's own bookkeeping. It is
reported as idle over busy time, the form of the textbook bubble: (p - 1) / m for GPipe and 1F1B, (p - 1) / (v m)
for interleaved schedules with v stages per rank, p ranks and m microbatches, when every stage does the same work.
The model's blocks are spread evenly over the stages, and its embedding and head are small, so that holds here.
For the schedules with several stages per rank two more columns say where the idle comes from: torch's own action
table with every action one slot, and that table run with each chunk's measured mean time and free communication
(`pipeline_timeline.simulated_bubble`): the schedule's shape alone. The measured bubble above the latter is the
sends, receives and the schedule's own work between chunks.

The peak per rank is the step's growth of the resident set over what the rank held before it (its parameters):
the activations its schedule keeps in flight and the gradients, which a pipeline allocates at its first backward
while later microbatches' activations are still held; `estimate_memory` predicts it (the "predicted" column).

On CPU each rank runs one intra-op thread. A run with more ranks than cores shares them (pp=4 on a 2-core machine):
a rank's chunks then take longer while its neighbours compute too, so its busy time and the bubble move with the
other ranks' load; the table says when ranks outnumber the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import GPT, GPTConfig
from tp_train.parallel.pipeline import SCHEDULES, Pipeline
from tp_train.tools.bench.measure import (
    current_memory,
    group_max,
    peak_memory,
    reset_peak_memory,
    return_freed_memory_at_once,
)
from tp_train.tools.bench.pipeline_timeline import TimedLoss, Timeline, schedule_table_bubble, simulated_bubble
from tp_train.tools.bench.plot import PANEL_HEIGHT, PANEL_WIDTH, figure, legend, panel
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB, estimate_memory
from tp_train.training.pipeline_split import plan_pipeline_split

# (pp, schedule, stages per rank); pp=1 is the model in one process, forward and backward over the whole batch
SETUPS = [
    (1, "one process", 1),
    (2, "gpipe", 1),
    (2, "1f1b", 1),
    (2, "interleaved_1f1b", 2),
    (2, "looped_bfs", 2),
    (2, "interleaved_zero_bubble", 2),
    (2, "zbv_zero_bubble", 2),
    (2, "dualpipev", 2),
    (4, "1f1b", 1),
    (4, "interleaved_1f1b", 2),
]
COLORS = ["#555555", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"]


def formula(pp: int, schedule: str, virtual: int, microbatches: int) -> float | None:
    """The textbook bubble over busy time with equal stages; None for the zero-bubble schedules, whose bubble
    depends on how backward splits into its input and weight halves."""
    if pp == 1:
        return 0.0
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) / microbatches
    if schedule in ("interleaved_1f1b", "looped_bfs"):
        return (pp - 1) / (virtual * microbatches)
    return None


def _model(args) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width, dropout=0.0)  # fmt: skip
    return GPT(config)


def _measure(rank, world_size, device, setup, args, out):
    pp, schedule, virtual = setup
    # else a step's peak hides in what the warm-up freed and malloc kept: a microbatch's tensors are small
    return_freed_memory_at_once(device, threshold=64 << 10)
    model = _model(args).to(device)
    batch = args.microbatches * args.microbatch_size
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (batch, args.seq), generator=generator).to(device)
    targets = torch.randint(0, args.vocab, (batch, args.seq), generator=generator).to(device)
    timeline = Timeline()
    if pp == 1:
        parameters = list(model.parameters())
        run = lambda: F.cross_entropy(model(ids).flatten(0, 1), targets.flatten()).backward()  # noqa: E731
    else:
        stages = pp * virtual
        split = plan_pipeline_split(model, stages, explicit=[args.layers // stages] * stages)
        loss = TimedLoss(timeline, stages - 1)
        pipeline = Pipeline(model, split, dist.group.WORLD, schedule, args.microbatches, device, loss)
        timeline.watch(pipeline)
        parameters = list(pipeline.parameters())
        run = lambda: pipeline.train_step(ids, targets)  # noqa: E731

    def step():
        for param in parameters:  # as a training loop's zero_grad: the step's peak holds its own gradients
            param.grad = None
        run()

    for _ in range(args.warmup):
        step()
    measured_since = time.perf_counter()
    walls, bubbles, busy_fractions = [], [], []
    for index in range(args.steps):
        dist.barrier()
        before = current_memory(device)
        if index == 0:
            reset_peak_memory(device)
        start = time.perf_counter()
        step()
        end = time.perf_counter()
        if index == 0:
            peak = peak_memory(device) - before
        busy = timeline.busy(start, end) if pp > 1 else end - start
        walls.append(end - start)
        bubbles.append((end - start - busy) / busy)
        busy_fractions.append(busy / (end - start))
    table = schedule_table_bubble(pipeline.torch_schedule) if virtual > 1 else None
    durations = [None] * world_size
    dist.all_gather_object(durations, timeline.mean_durations(measured_since))
    merged = {what: seconds for rank_durations in durations for what, seconds in rank_durations.items()}
    simulated = simulated_bubble(pipeline.torch_schedule, merged, pp * virtual) if virtual > 1 else None
    wall = group_max(statistics.median(walls), dist.group.WORLD, device)
    row = {"pp": pp, "schedule": schedule, "virtual_stages": virtual, "microbatches": args.microbatches,
           "seconds": wall, "tokens_per_s": batch * args.seq / wall,
           "peak_mib_per_rank": group_max(peak, dist.group.WORLD, device) / MIB,
           "formula": formula(pp, schedule, virtual, args.microbatches), "schedule_table": table,
           "schedule_table_at_measured_chunks": simulated,
           "chunk_ms": {f"{name} {stage}": 1e3 * seconds for (name, stage), seconds in sorted(merged.items())},
           "cores": os.cpu_count(), "ranks": world_size}  # fmt: skip
    measured = [None] * world_size
    dist.all_gather_object(measured, (statistics.median(bubbles), statistics.median(busy_fractions)))
    row["bubble_per_rank"] = [bubble for bubble, _ in measured]
    row["busy_fraction_per_rank"] = [fraction for _, fraction in measured]
    row["bubble"] = statistics.mean(row["bubble_per_rank"])
    if rank == 0:
        Path(out).write_text(json.dumps(row))


def predicted_growth(setup: tuple, args) -> int:
    """`estimate_memory`'s peak of the step above the parameters (no optimizer runs here), for the rank that holds
    the most."""
    pp, schedule, virtual = setup
    with torch.device("meta"):
        model = _model(args)
    estimate = estimate_memory(
        model, args.microbatches * args.microbatch_size, args.seq, pp=pp, pipeline_schedule="1f1b" if pp == 1 else
        schedule, pipeline_microbatches=args.microbatches, pipeline_virtual_stages=virtual,
    )  # fmt: skip
    return estimate.total - estimate.parameters - estimate.optimizer_states


def svg_plot(rows: list[dict], path: Path) -> None:
    """Two panels against pp, one line per schedule: tokens/s and the measured bubble (the formula's, dashed)."""
    schedules = list(dict.fromkeys(row["schedule"] for row in rows if row["pp"] > 1))
    base = [row for row in rows if row["pp"] == 1]
    styles = {name: (COLORS[(index + 1) % len(COLORS)], "") for index, name in enumerate(schedules)}
    styles |= {f"{name} formula": (styles[name][0], "6,3") for name in schedules}
    throughput = {name: sorted((row["pp"], row["tokens_per_s"]) for row in base + rows if row["schedule"] == name
                               or row["pp"] == 1) for name in schedules}  # fmt: skip
    bubble = {name: sorted((row["pp"], row["bubble"]) for row in rows if row["schedule"] == name) for name in schedules}
    bubble |= {f"{name} formula": sorted((row["pp"], row["formula"]) for row in rows if row["schedule"] == name
                                         and row["formula"] is not None) for name in schedules}  # fmt: skip
    bubble = {name: points for name, points in bubble.items() if points}
    xs = sorted({row["pp"] for row in rows})
    body = panel(0, "tokens/s", throughput, styles, xs, "pp", log=False)
    body += panel(PANEL_WIDTH, "bubble (idle / busy)", bubble, styles, [x for x in xs if x > 1], "pp", log=False)
    body += legend([(name, *styles[name]) for name in schedules], PANEL_HEIGHT + 22, per_row=3, spacing=230)
    path.write_text(figure(body, 2 * PANEL_WIDTH, PANEL_HEIGHT + 80))


def table(rows: list[dict]) -> str:
    """Markdown rows, tokens/s against pp=1's."""
    base = next((row for row in rows if row["pp"] == 1), None)
    lines = [
        "| pp | schedule | v | m | tokens/s | vs pp=1 | peak MiB / rank | predicted | bubble (per rank) | formula "
        "| torch's table | at measured chunks |",
        "|--:|---|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for row in rows:
        ratio = f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else "-"
        per_rank = ", ".join(f"{bubble:.3f}" for bubble in row["bubble_per_rank"])
        shared = " (ranks > cores)" if row["ranks"] > (row["cores"] or 1) else ""
        expected = "-" if row["formula"] is None else f"{row['formula']:.3f}"
        table, chunks = (f"{row[key]:.3f}" if row.get(key) is not None else "-"
                         for key in ("schedule_table", "schedule_table_at_measured_chunks"))  # fmt: skip
        lines.append(
            f"| {row['pp']} | {row['schedule']}{shared} | {row['virtual_stages']} | {row['microbatches']} | "
            f"{row['tokens_per_s']:.0f} | {ratio} | {row['peak_mib_per_rank']:.1f} | "
            f"{row['predicted_mib_per_rank']:.1f} | {row['bubble']:.3f} ({per_rank}) | {expected} | {table} | "
            f"{chunks} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.pipeline", description=__doc__)
    parser.add_argument("--setups", default=",".join(f"{pp}:{name}" for pp, name, _ in SETUPS),
                        help="pp:schedule pairs from SETUPS, comma-separated")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8, help="blocks (a multiple of pp x stages per rank)")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256, help="small, so that the blocks are the stages' work")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=32, help="the bubble's formula falls as 1 / m")
    parser.add_argument("--microbatch-size", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="measured steps; the median is reported")
    parser.add_argument("--output", default="bench_pipeline.json")
    args = parser.parse_args(argv)
    chosen = [s for s in SETUPS if f"{s[0]}:{s[1]}" in args.setups.split(",")]
    unknown = set(args.setups.split(",")) - {f"{s[0]}:{s[1]}" for s in SETUPS}
    if unknown:
        raise SystemExit(f"--setups: {', '.join(sorted(unknown))} not in {', '.join(f'{p}:{n}' for p, n, _ in SETUPS)}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for setup in chosen:
            assert setup[0] == 1 or setup[1] in SCHEDULES, setup
            out = Path(scratch) / "row.json"
            start_ranks(_measure, setup[0], setup, args, str(out))
            rows.append(json.loads(out.read_text()) | {"predicted_mib_per_rank": predicted_growth(setup, args) / MIB})
    output = Path(args.output)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu, one thread per rank"
    output.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    svg_plot(rows, output.with_suffix(".svg"))
    print(table(rows), f"wrote {output} and {output.with_suffix('.svg')}", sep="\n")


if __name__ == "__main__":
    main()
