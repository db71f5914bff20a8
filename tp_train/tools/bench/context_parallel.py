"""`python -m tp_train.tools.bench.context_parallel`: each rank's measured peak memory and the tokens/s of one
forward + backward of causal attention over the whole sequence, against sequence length: torch's SDPA in one process,
and `context_parallel_attention` at cp = 1, 2 and 4 (ring, all-gather and all-to-all), with and without packed
documents.
Prints one table, writes JSON and an SVG plot (no plotting library needed).

Time is the slowest rank's wall time, and each rank's CPU time: on a machine shared with other work the CPU time shows
the work a rank does, the wall time also its waits. The peak is measured, not modelled: on CPU the process's peak
resident set (VmHWM, reset before the step, freed blocks of 1 MiB or more handed back at once) above its resident set
before the step; on CUDA the allocator's peak above what was allocated before. Every rank holds its own share of q,
k, v and the output gradient before the step.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_train.parallel.context_parallel import context_parallel_attention, shard_sequence
from tp_train.tools.bench.measure import (
    current_memory,
    group_max,
    peak_memory,
    reset_peak_memory,
    return_freed_memory_at_once,
)
from tp_train.tools.bench.plot import PANEL_HEIGHT, PANEL_WIDTH, figure, legend, panel
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB

# (name, cp, rotation (None: torch's SDPA on the whole sequence), packed documents)
SETUPS = [
    ("sdpa", 1, None, False),
    ("cp=1", 1, "ring", False),
    ("cp=1 masked", 1, "ring", True),
    ("cp=2 ring", 2, "ring", False),
    ("cp=2 allgather", 2, "allgather", False),
    ("cp=2 alltoall", 2, "alltoall", False),
    ("cp=2 ring masked", 2, "ring", True),
    ("cp=2 alltoall masked", 2, "alltoall", True),
    ("cp=4 ring", 4, "ring", False),
    ("cp=4 alltoall", 4, "alltoall", False),
    ("cp=4 ring masked", 4, "ring", True),
]
DOCUMENTS = (512, 4096)  # packed documents' lengths are drawn from this range (the last one is cut at the end)
PANELS = (("peak_mib_per_rank", "measured peak MiB per rank"), ("tokens_per_s", "tokens/s"))
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf", "#7f7f7f"]


def document_ids(length: int, generator: torch.Generator) -> torch.Tensor:
    """(1, length) ids of packed documents whose lengths are drawn uniformly from DOCUMENTS."""
    lengths = []
    while sum(lengths) < length:
        lengths.append(int(torch.randint(DOCUMENTS[0], DOCUMENTS[1] + 1, (1,), generator=generator)))
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return ids[:length].unsqueeze(0)


def _inputs(length, args, rank, cp, masked, device):
    """This rank's shares of q, k, v, the output gradient and the document ids (all seeded, as on one process)."""
    generator = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, length, args.head_dim)
    kv_shape = (args.batch, args.kv_heads, length, args.head_dim)
    tensors = [torch.randn(size, generator=generator) for size in (shape, kv_shape, kv_shape, shape)]
    ids = document_ids(length, generator) if masked else None
    share = lambda t, dim: shard_sequence(t, cp, rank, dim=dim).to(device).clone()  # noqa: E731
    q, k, v, grad = (share(t, 2) for t in tensors)
    return q, k, v, grad, None if ids is None else share(ids, 1)


def _measure(rank, world_size, device, setup, lengths, args, out):
    name, cp, rotation, masked = setup
    return_freed_memory_at_once(device)
    group = dist.group.WORLD
    rows = []
    for length in [min(lengths[0], 2048), *lengths]:  # a short warm-up first (thread pools, gloo buffers)
        q, k, v, grad, ids = _inputs(length, args, rank, cp, masked, device)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        if rotation is None and masked:
            raise ValueError(f"{name}: torch's SDPA would need a dense T x T mask; use cp=1 masked")
        dist.barrier(group=group)
        before = current_memory(device)
        reset_peak_memory(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        if rotation is None:
            out_ = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            out_ = context_parallel_attention(q, k, v, group, document_ids=ids, rotation=rotation)
        out_.backward(grad)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        peak = peak_memory(device) - before
        del out_, q, k, v, grad
        seconds = group_max(seconds, group, device)  # the slowest rank's, and the largest peak
        rows.append({"setup": name, "seq_len": length, "peak_mib_per_rank": group_max(peak, group, device) / MIB,
                     "seconds": seconds, "cpu_seconds_per_rank": group_max(cpu_seconds, group, device),
                     "tokens_per_s": args.batch * length / seconds})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows[1:]))


def svg_plot(rows: list[dict], path: Path) -> None:
    """Two panels, activation MiB per rank and tokens/s against sequence length, one line per setup."""
    setups = list(dict.fromkeys(row["setup"] for row in rows))
    lengths = sorted({row["seq_len"] for row in rows})
    styles = {setup: (COLORS[index % len(COLORS)], "") for index, setup in enumerate(setups)}
    body = []
    for index, (key, title) in enumerate(PANELS):
        lines = {setup: sorted((row["seq_len"], row[key]) for row in rows if row["setup"] == setup) for setup in setups}
        body += panel(index * PANEL_WIDTH, title, lines, styles, lengths, "sequence length", log=False)
    body += legend([(setup, *styles[setup]) for setup in setups], PANEL_HEIGHT + 22, per_row=3, spacing=230)
    path.write_text(figure(body, 2 * PANEL_WIDTH, PANEL_HEIGHT + 80))


def _ratio(value: float, reference: float) -> str:
    """`value / reference`, or "n/a" where the reference's peak read 0 (the step fit in memory already resident)."""
    return f"{value / reference:.2f}" if reference else "n/a"


def table(rows: list[dict]) -> str:
    """Markdown rows, each against the first setup measured at its length (SDPA in one process by default)."""
    base = {}
    for row in rows:
        base.setdefault(row["seq_len"], row)
    lines = [
        "| setup | seq len | measured peak MiB / rank | vs first | seconds | CPU s / rank | tokens/s | time vs first |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        ref = base[row["seq_len"]]
        lines.append(
            f"| {row['setup']} | {row['seq_len']} | {row['peak_mib_per_rank']:.1f} | "
            f"{_ratio(row['peak_mib_per_rank'], ref['peak_mib_per_rank'])} | {row['seconds']:.2f} | "
            f"{row['cpu_seconds_per_rank']:.2f} | "
            f"{row['tokens_per_s']:.0f} | {row['seconds'] / ref['seconds']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.context_parallel", description=__doc__)
    parser.add_argument("--lengths", default="4096,16384,65536", help="sequence lengths, comma-separated")
    parser.add_argument("--heads", type=int, default=8, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=2, help="key/value heads (grouped-query attention)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--setups", default=",".join(s[0] for s in SETUPS), help="names from SETUPS, comma-separated")
    parser.add_argument("--output", default="bench_context_parallel.json")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    chosen = [s for s in SETUPS if s[0] in args.setups.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for setup in chosen:
            out = Path(scratch) / "rows.json"
            start_ranks(_measure, setup[1], setup, lengths, args, str(out))
            rows += json.loads(out.read_text())
    output = Path(args.output)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu, one thread per rank"
    output.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    svg_plot(rows, output.with_suffix(".svg"))
    print(table(rows), f"wrote {output} and {output.with_suffix('.svg')}", sep="\n")


if __name__ == "__main__":
    main()
