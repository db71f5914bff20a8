"""`python -m tp_train.tools.bench.data_parallel`: data parallelism over tensor parallelism at dp2 x tp2 (4 ranks),
DDP against sharded data parallelism (FSDP2), in one run: step time and model state per rank.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from models import GPT
from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.contenders import SIZES, Size, TrainingStep
from tp_train.tools.bench.measure import group_max, seconds_per_step
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB, estimate_memory
from tp_train.training.data_parallel import fully_shard_data_parallel

DP, TP = 2, 2
MODES = ("ddp", "fsdp")


def build(mode: str, size: Size, mesh: ParallelMesh, device: torch.device) -> TrainingStep:
    torch.manual_seed(0)
    model = GPT(size.config()).to(device)
    generator = torch.Generator().manual_seed(1 + mesh.data_parallel.get_local_rank())  # a batch per dp rank
    batch = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=generator).to(device)
    parallelize(model, mesh.tensor_parallel, verify=False)
    if mode == "ddp":
        return TrainingStep(DistributedDataParallel(model, process_group=mesh.data_parallel.get_group()), batch)
    fully_shard_data_parallel(model, [model], mesh.data_parallel)
    return TrainingStep(model, batch)


def benchmark(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    dims = ParallelDims.from_world(world_size, tp=TP)  # DDP's and FSDP2's dp: the data-parallel axis either way
    dims.validate()
    mesh = dims.build_mesh(device.type)
    world = dist.group.WORLD
    results = []
    for name in args.sizes.split(","):
        size = SIZES[name]
        steps = {mode: build(mode, size, mesh, device) for mode in MODES}
        for step in steps.values():
            seconds_per_step(step, 1, world, device)  # warm-up: first-step allocations, optimizer state
        times = {mode: [] for mode in MODES}
        for repeat in range(args.repeats):
            for mode in MODES[repeat % 2 :] + MODES[: repeat % 2]:
                times[mode].append(seconds_per_step(steps[mode], args.steps, world, device))
        with torch.device("meta"):
            meta_model = GPT(size.config())
        rows = {}
        for mode, step in steps.items():
            predicted = estimate_memory(meta_model, size.batch, size.seq, tp=dims.tp, dp=dims.dp, data_parallel=mode)
            rows[mode] = {
                "step_s": statistics.median(times[mode]),
                "step_s_repeats": times[mode],
                "tokens_per_s": dims.dp * size.batch * size.seq / statistics.median(times[mode]),
                "model_state_mib": group_max(step.model_state_bytes(), world, device) / MIB,
                "predicted_state_mib": predicted.model_states / MIB,
            }
        results.append({"size": name, "contenders": rows})
        del steps
    if rank == 0:
        Path(args.output).write_text(json.dumps(results, indent=1))
        print(table(results), f"wrote {args.output}", sep="\n")


def table(results: list[dict]) -> str:
    header = (
        f"{'size':<7} {'contender':<20} {'step ms':>8} {'tokens/s':>9} {'vs ddp':>7} {'state MiB':>9} "
        f"{'predicted':>9} {'state vs ddp':>12}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        ddp = result["contenders"]["ddp"]
        for mode, row in result["contenders"].items():
            lines.append(
                f"{result['size']:<7} {f'ours dp{DP} x tp{TP} {mode}':<20} {1000 * row['step_s']:8.1f} "
                f"{row['tokens_per_s']:9.0f} {row['step_s'] / ddp['step_s']:6.2f}x {row['model_state_mib']:9.2f} "
                f"{row['predicted_state_mib']:9.2f} {row['model_state_mib'] / ddp['model_state_mib']:11.2f}x"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.data_parallel", description=__doc__)
    parser.add_argument("--sizes", default="medium,large", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument("--repeats", type=int, default=7, help="timings per contender (the median is reported)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per timing")
    parser.add_argument("--output", default="bench_data_parallel.json", help="where the JSON results go")
    args = parser.parse_args(argv)
    unknown = [name for name in args.sizes.split(",") if name not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    start_ranks(benchmark, ParallelDims.devices_for(dp=DP, tp=TP), args)


if __name__ == "__main__":
    main()
