"""`python -m tp_train.tools.bench.checkpoint`: how long a checkpoint save blocks training, written before the step
continues (`sync`) against staged and written in the background (`async`, `AsyncCheckpointWriter`), in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from models import GPT, GPTConfig
from tp_train.checkpoint.async_writer import AsyncCheckpointWriter
from tp_train.checkpoint.dcp import save
from tp_train.parallel.dims import ParallelDims
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.contenders import TrainingStep
from tp_train.tools.bench.measure import group_max, seconds_per_step
from tp_train.tools.bench.ranks import start_ranks

MODES = ("sync", "async")


def benchmark(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    dims = ParallelDims.from_world(world_size, tp=world_size)
    dims.validate()
    mesh = dims.build_mesh(device.type)
    group = dist.group.WORLD
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.n_layer, n_head=args.n_head,
                       n_embd=args.n_embd)  # fmt: skip
    model = parallelize(GPT(config).to(device), mesh.tensor_parallel, verify=False)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    step = TrainingStep(model, batch.to(device))
    step()  # AdamW's state exists, as in any checkpoint after the first step
    writer = AsyncCheckpointWriter()
    # One directory for every rank: the launching process's pid names it.
    directory = Path(args.directory or Path(tempfile.gettempdir(), f"tp-train-bench-checkpoint-{os.getppid()}"))
    rows: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    for repeat in range(args.repeats):
        for mode in MODES[repeat % 2 :] + MODES[: repeat % 2]:
            times = rows[mode]
            times.setdefault("step_s", []).append(seconds_per_step(step, args.steps, group, device))
            dist.barrier(group)
            start = time.perf_counter()
            asynchronously = writer if mode == "async" else None
            save(directory / "last.ckpt", model, [step.optimizer], mesh.root, writer=asynchronously)
            blocked = time.perf_counter() - start
            during = seconds_per_step(step, args.steps, group, device)
            writer.wait()
            complete = time.perf_counter() - start
            times.setdefault("blocked_s", []).append(group_max(blocked, group, device))
            times.setdefault("steps_during_s", []).append(during)
            times.setdefault("complete_s", []).append(group_max(complete, group, device))
    if rank == 0:
        shutil.rmtree(directory, ignore_errors=True)
        medians = {
            mode: {key: statistics.median(values) for key, values in times.items()} for mode, times in rows.items()
        }
        results = {"model": vars(args), "modes": medians, "repeats": rows}
        Path(args.output).write_text(json.dumps(results, indent=1, default=str))
        print(table(results), f"wrote {args.output}", sep="\n")


def table(results: dict) -> str:
    header = f"{'mode':<6} {'step ms':>8} {'blocked ms':>10} {'steps during ms':>15} {'complete s':>10}"
    lines = [header, "-" * len(header)]
    for mode, row in results["modes"].items():
        lines.append(
            f"{mode:<6} {1000 * row['step_s']:8.1f} {1000 * row['blocked_s']:10.1f} "
            f"{1000 * row['steps_during_s']:15.1f} {row['complete_s']:10.2f}"
        )
    sync, background = results["modes"]["sync"], results["modes"]["async"]
    lines.append(f"blocked by a save, async / sync: {background['blocked_s'] / sync['blocked_s']:.3f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.checkpoint", description=__doc__)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks)")
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="saves per mode (the median is reported)")
    parser.add_argument("--steps", type=int, default=3, help="training steps timed before and after each save")
    parser.add_argument("--directory", default=None, help="where checkpoints are written (default: a temp dir)")
    parser.add_argument("--output", default="bench_checkpoint.json", help="where the JSON results go")
    args = parser.parse_args(argv)
    start_ranks(benchmark, args.tp, args)


if __name__ == "__main__":
    main()
