"""`python -m tp_train.tools.bench.step_time`: the time model (`tp_train.tools.step_time`) against measured steps.

Each layout's step is simulated in this process (`tp_train.tools.choose.simulated_ranks`: rank 0 and, under a
pipeline, its last rank) and priced with a hardware profile (this machine's CPU profile by default), then run for
real on gloo ranks (each with the intra-op threads Lightning's launcher gives it: the cores over the ranks, at least
one) and timed: the median step of the slowest rank. One table: predicted and measured milliseconds a step, their
ratio, and the predicted parts. The model and batch are fixed; each data-parallel rank takes its own batch of that
size. `--choose` runs the chooser's sweep instead: its candidates, and every one that fits measured."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from models import GPT, GPTConfig
from tp_train.parallel.dims import ParallelDims
from tp_train.tools.bench.measure import group_max
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.choose import Layout, choose_layout, simulated_ranks
from tp_train.tools.choose import table as choice_table
from tp_train.tools.hardware import PROFILES, profile_named
from tp_train.tools.memory import MIB
from tp_train.tools.step_time import predict_step_time
from tp_train.tools.steps import language_model_step
from tp_train.training.apply_order import TrainingOptions, parallelize_for_training

MICROBATCHES = 4


def _layout(batch, world_size, tp=1, pp=1, data_parallel="ddp", schedule="1f1b", virtual_stages=1) -> Layout:
    """A layout of the chooser's kind, `batch` sequences a rank, `MICROBATCHES` of them under a pipeline."""
    dims = ParallelDims.from_world(world_size, tp=tp, pp=pp, data_parallel=data_parallel, virtual_stages=virtual_stages)
    dims.validate()
    microbatches = MICROBATCHES if pp > 1 else 1
    options = TrainingOptions(
        loss_parallel=True, data_parallel=data_parallel, pipeline_schedule=schedule,
        pipeline_microbatches=microbatches if pp > 1 else None,
    )  # fmt: skip
    return Layout(dims, options, micro_batch=batch, accumulation=1, microbatches=microbatches)


def layouts(batch: int) -> list[Layout]:
    """The benchmark's layouts, of 1, 2 and 4 ranks."""
    return [
        _layout(batch, 1),
        _layout(batch, 2, tp=2),
        _layout(batch, 2, data_parallel="ddp"),
        _layout(batch, 2, data_parallel="fsdp"),
        _layout(batch, 2, pp=2),
        _layout(batch, 2, pp=2, schedule="interleaved_1f1b", virtual_stages=2),
        _layout(batch, 4, tp=4),
        _layout(batch, 4, tp=2, data_parallel="ddp"),
        _layout(batch, 4, tp=2, pp=2),
    ]


def model_config(args) -> GPTConfig:
    return GPTConfig(
        vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width,
        dropout=0.0,
    )  # fmt: skip


def predicted(layout: Layout, args) -> dict:
    config = model_config(args)
    steps = simulated_ranks(lambda: GPT(config), layout, args.seq, args.vocab)
    return asdict(predict_step_time(steps, layout.dims, profile_named(args.hardware), layout.microbatches))


def _measure(rank, world_size, device, dims, options, micro_batch, accumulation, args, out: Path) -> None:
    """The median seconds of an optimizer step (its `accumulation` micro-batches of `micro_batch` sequences) on the
    slowest rank, written to `out` by rank 0."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))  # as Lightning's launcher sets it
    torch.manual_seed(0)
    training = parallelize_for_training(GPT(model_config(args)), dims, dims.build_mesh(device.type), device, options)
    optimizer = torch.optim.AdamW(training.root.parameters())
    step = language_model_step(micro_batch, args.seq, args.vocab, generator=torch.Generator().manual_seed(rank))
    times = []
    for index in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        for micro in range(accumulation):
            with training.no_sync() if micro < accumulation - 1 else contextlib.nullcontext():
                step(training)
                training.after_backward()
        optimizer.step()
        optimizer.zero_grad()
        if index >= args.warmup:
            times.append(time.perf_counter() - start)
    slowest = group_max(statistics.median(times), dist.group.WORLD, device)
    if rank == 0:
        out.write_text(json.dumps({"measured": slowest}))


def measured(dims, options, micro_batch: int, accumulation: int, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "measured.json"
        start_ranks(_measure, dims.world_size, dims, options, micro_batch, accumulation, args, out)
        return json.loads(out.read_text())["measured"]


def choice_sweep(args) -> None:
    """The chooser's candidates for `--world` ranks under `--memory-mib`, and every fitting one measured."""
    config, memory = model_config(args), args.memory_mib * MIB
    candidates = choose_layout(
        lambda: GPT(config), args.world, args.global_batch, args.seq, args.vocab, memory, profile_named(args.hardware)
    )
    print(choice_table(candidates, memory), flush=True)
    rows = []
    for candidate in (c for c in candidates if c.fits):
        layout = candidate.layout
        seconds = measured(layout.dims, layout.options, layout.micro_batch, layout.accumulation, args)
        rows.append({"layout": layout.label(), "memory_mib": candidate.memory / MIB,
                     "predicted_tokens_per_s": candidate.tokens_per_s,
                     "measured_tokens_per_s": args.global_batch * args.seq / seconds})  # fmt: skip
        row = rows[-1]
        print(f"{row['layout']:<44} {row['memory_mib']:8.1f} MiB {row['predicted_tokens_per_s']:9.0f} "
              f"{row['measured_tokens_per_s']:9.0f}", flush=True)  # fmt: skip
    best = max(row["measured_tokens_per_s"] for row in rows)
    slowest = min(row["measured_tokens_per_s"] for row in rows)
    over = sum(not c.fits for c in candidates)
    chosen = rows[0]
    print(
        f"chosen: {chosen['layout']}, measured {chosen['measured_tokens_per_s'] / best:.2f} of the best measured; "
        f"fastest / slowest measured {best / slowest:.2f}; {over} layouts over the memory or unshardable"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


def table(rows: list[dict]) -> str:
    lines = [
        f"{'layout':<44} {'ranks':>5} {'predicted ms':>12} {'measured ms':>11} {'ratio':>6} "
        f"{'compute':>8} {'comm':>7} {'bubble':>7}"
    ]
    for row in rows:
        p = row["predicted"]
        p["total"] = p["compute"] + p["communication"] + p["bubble"] + p["sharing"]
        lines.append(
            f"{row['layout']:<44} {row['ranks']:>5} {p['total'] * 1e3:12.1f} {row['measured'] * 1e3:11.1f} "
            f"{p['total'] / row['measured']:6.2f} {p['compute'] * 1e3:8.1f} {p['communication'] * 1e3:7.1f} "
            f"{p['bubble'] * 1e3:7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.step_time", description=__doc__)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--hardware", default="cpu-2core", choices=sorted(PROFILES))
    parser.add_argument("--layouts", type=int, nargs="*", help="indices into layouts() (default: all)")
    parser.add_argument("--output", default=None, help="write the rows as JSON here")
    parser.add_argument("--choose", action="store_true", help="the chooser's sweep instead (tools/choose.py)")
    parser.add_argument("--world", type=int, default=4, help="--choose: the ranks")
    parser.add_argument("--memory-mib", type=float, default=64.0, help="--choose: each rank's memory")
    parser.add_argument("--global-batch", type=int, default=16, help="--choose: sequences per optimizer step")
    args = parser.parse_args(argv)
    if args.choose:
        choice_sweep(args)
        return
    every = layouts(args.batch)
    rows = []
    for layout in [every[index] for index in args.layouts] if args.layouts else every:
        prediction = predicted(layout, args)
        seconds = measured(layout.dims, layout.options, layout.micro_batch, 1, args)
        rows.append({"layout": layout.label(), "ranks": layout.dims.world_size, "predicted": prediction,
                     "measured": seconds})  # fmt: skip
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
