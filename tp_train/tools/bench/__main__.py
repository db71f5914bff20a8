"""`tp-train-bench` (or `python -m tp_train.tools.bench`): training-step time and memory of tp_train against
PyTorch's DTensor tensor parallelism and the plain model, in one run (see tp_train/tools/bench/run.py). Prints a
table and its targets, writes JSON and a plot of step time and memory against tp (plot.py)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from tp_train.tools.bench.contenders import SIZES
from tp_train.tools.bench.plot import svg
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.bench.report import table, targets, targets_text
from tp_train.tools.bench.run import benchmark


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_at_start": os.getloadavg(),
    }


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, info: dict) -> None:
    start = time.perf_counter()
    if args.profile is not None and rank == 0:
        args.profile.mkdir(parents=True, exist_ok=True)
    sizes = [SIZES[name] for name in args.sizes.split(",")]
    results = benchmark(rank, sizes, args.tp, args.repeats, args.seconds, device, args.profile, args.compiled)
    if rank == 0:
        # Named in a rank: CUDA initialised in the launching process would not survive start_ranks' fork.
        info["cuda"] = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        info = {**info, "load_average_at_end": os.getloadavg(), "seconds": time.perf_counter() - start}
        checks = targets(results)
        report = {"machine": info, "results": results, "targets": checks}
        Path(args.output).write_text(json.dumps(report, indent=1))
        args.plot.write_text(svg(report))
        print(f"machine: {info}", table(results), "targets:", targets_text(checks), sep="\n")
        print(f"wrote {args.output} and {args.plot}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench", description=__doc__)
    parser.add_argument("--sizes", default="small,medium,large", help=f"comma-separated, from {sorted(SIZES)}")
    parser.add_argument("--tp", default="1,2,4", help="tensor-parallel sizes, comma-separated")
    parser.add_argument("--repeats", type=int, default=7, help="timings per contender (the median is reported)")
    parser.add_argument("--seconds", type=float, default=0.5, help="about how long one timing runs (>= 1 step)")
    parser.add_argument("--output", default="bench.json", help="where the JSON results go")
    parser.add_argument("--plot", default=None, help="where the SVG plot goes (default: --output's name, .svg)")
    parser.add_argument(
        "--no-compiled", dest="compiled", action="store_false", help="leave out the torch.compile contenders"
    )
    parser.add_argument("--profile", type=Path, default=None, help="a directory for per-contender profiler tables")
    args = parser.parse_args(argv)
    unknown = [name for name in args.sizes.split(",") if name not in SIZES]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; choose from {sorted(SIZES)}")
    args.tp = sorted({int(tp) for tp in args.tp.split(",")})
    args.plot = Path(args.plot) if args.plot else Path(args.output).with_suffix(".svg")
    start_ranks(_rank, max(args.tp), args, machine())


if __name__ == "__main__":
    main()
