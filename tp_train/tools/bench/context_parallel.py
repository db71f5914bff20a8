"""`python -m tp_train.tools.bench.context_parallel`: activation memory per rank and tokens/s of a GPT training step
against sequence length, at cp=1, cp=2 (ring and all-gather, with and without a document mask) and tp=2 x cp=2.
Prints one table, writes JSON and an SVG plot (no plotting library needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_train.tools.activation_memory import saved_activation_bytes
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB

# (name, cp, tp, rotation, document mask)
SETUPS = [
    ("cp=1", 1, 1, None, False),
    ("cp=1 masked", 1, 1, "ring", True),
    ("cp=2 ring", 2, 1, "ring", False),
    ("cp=2 allgather", 2, 1, "allgather", False),
    ("cp=2 ring masked", 2, 1, "ring", True),
    ("tp=2 x cp=2 ring", 2, 2, "ring", False),
]
DOCUMENT = 128  # tokens per packed document when masked


def _measure(rank, world_size, device, setup, lengths, args, out):
    from models import GPT, GPTConfig
    from tp_train.plan.context_parallel import mean_over_group, shard_targets
    from tp_train.plan.parallelize import parallelize

    name, cp, tp, rotation, masked = setup
    mesh = torch.distributed.device_mesh.init_device_mesh(
        device.type, (cp, tp), mesh_dim_names=("context_parallel", "tensor_parallel")
    )
    rows = []
    for length in lengths:
        torch.manual_seed(0)
        config = GPTConfig(
            vocab_size=512, block_size=length, n_layer=args.layers, n_head=args.heads, n_embd=args.hidden, dropout=0.0
        )
        model = GPT(config).to(device)
        tokens = torch.randint(1, 512, (args.batch, length + 1), device=device)
        if masked:
            tokens[:, DOCUMENT - 1 :: DOCUMENT] = 0
        options = {"rotation": rotation, "document_separator": 0 if masked else None}
        cp_group = mesh["context_parallel"].get_group() if rotation else None
        parallelize(model, mesh["tensor_parallel"].get_group(), verify=False, cp_group=cp_group, cp_options=options)
        inputs, targets = tokens[:, :-1], tokens[:, 1:]

        def step(model=model, inputs=inputs, targets=targets, cp_group=cp_group):
            logits = model(inputs)
            if cp_group is None:
                return F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            local = shard_targets(targets, model.tp_context_parallel)
            loss = F.cross_entropy(logits.flatten(0, 1), local.flatten())
            return mean_over_group(loss, torch.tensor(local.numel(), device=device), cp_group)

        saved, loss = saved_activation_bytes(model, step)
        loss.backward()
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            step().backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = torch.tensor(statistics.median(times))
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
        peak = torch.tensor(float(saved))
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        rows.append({"setup": name, "seq_len": length, "activation_mib_per_rank": peak.item() / MIB,
                     "tokens_per_s": args.batch * length / seconds.item()})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


def svg_plot(rows: list[dict], path: Path) -> None:
    """Two panels, activation MiB per rank and tokens/s against sequence length, one line per setup."""
    setups = list(dict.fromkeys(row["setup"] for row in rows))
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"]
    lengths = sorted({row["seq_len"] for row in rows})
    width, height, pad = 420, 300, 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * width}" height="{height + 90}" font-size="11">']
    for panel, (key, title) in enumerate((("activation_mib_per_rank", "activation MiB per rank"),
                                          ("tokens_per_s", "tokens/s per replica"))):  # fmt: skip
        x0, top = panel * width + pad, 25
        top_value = max(row[key] for row in rows) * 1.1

        def x_of(n, x0=x0):
            return x0 + lengths.index(n) * (width - 2 * pad) / max(len(lengths) - 1, 1)

        def y_of(v, top=top, top_value=top_value):
            return top + (height - top - pad) * (1 - v / top_value)

        parts.append(f'<text x="{x0}" y="15" font-weight="bold">{title} vs sequence length</text>')
        right, bottom = x0 + width - 2 * pad, height - pad
        parts.append(f'<line x1="{x0}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="black"/>')
        parts.append(f'<line x1="{x0}" y1="{top}" x2="{x0}" y2="{height - pad}" stroke="black"/>')
        for n in lengths:
            parts.append(f'<text x="{x_of(n)}" y="{height - pad + 14}" text-anchor="middle">{n}</text>')
        for fraction in (0, 0.5, 1):
            value = top_value * fraction
            parts.append(f'<text x="{x0 - 4}" y="{y_of(value) + 4}" text-anchor="end">{value:.0f}</text>')
        for index, setup in enumerate(setups):
            points = sorted((row["seq_len"], row[key]) for row in rows if row["setup"] == setup)
            coords = " ".join(f"{x_of(n):.1f},{y_of(v):.1f}" for n, v in points)
            color = colors[index % len(colors)]
            parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="2"/>')
    for index, setup in enumerate(setups):
        x, y = pad + (index % 3) * 260, height + 20 + (index // 3) * 18
        color = colors[index % len(colors)]
        parts.append(f'<rect x="{x}" y="{y - 9}" width="12" height="4" fill="{color}"/>')
        parts.append(f'<text x="{x + 16}" y="{y - 4}">{setup}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def table(rows: list[dict]) -> str:
    base = {row["seq_len"]: row for row in rows if row["setup"] == "cp=1"}
    lines = ["| setup | seq len | activation MiB / rank | vs cp=1 | tokens/s | vs cp=1 |", "|---|--:|--:|--:|--:|--:|"]
    for row in rows:
        ref = base[row["seq_len"]]
        lines.append(
            f"| {row['setup']} | {row['seq_len']} | {row['activation_mib_per_rank']:.1f} | "
            f"{row['activation_mib_per_rank'] / ref['activation_mib_per_rank']:.2f} | {row['tokens_per_s']:.0f} | "
            f"{row['tokens_per_s'] / ref['tokens_per_s']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.context_parallel", description=__doc__)
    parser.add_argument("--lengths", default="256,512,1024,2048", help="sequence lengths, comma-separated")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--setups", default=",".join(s[0] for s in SETUPS), help="names from SETUPS, comma-separated")
    parser.add_argument("--output", default="bench_context_parallel.json")
    args = parser.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    chosen = [s for s in SETUPS if s[0] in args.setups.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for setup in chosen:
            out = Path(scratch) / "rows.json"
            start_ranks(_measure, setup[1] * setup[2], setup, lengths, args, str(out))
            rows += json.loads(out.read_text())
    output = Path(args.output)
    output.write_text(json.dumps({"device": "cuda" if torch.cuda.is_available() else "cpu", "rows": rows}, indent=1))
    svg_plot(rows, output.with_suffix(".svg"))
    print(table(rows))
    print(f"wrote {output} and {output.with_suffix('.svg')}")


if __name__ == "__main__":
    main()
