"""`python -m tp_train.tools.bench.context_parallel`: activation memory per rank and tokens/s of a GPT training step
against sequence length, at cp=1, cp=2 (ring and all-gather, with and without a document mask) and tp=2 x cp=2.
Prints one table, writes JSON and an SVG plot (no plotting library needed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_train.tools.activation_memory import saved_activation_bytes
from tp_train.tools.bench.measure import group_max, seconds_per_step
from tp_train.tools.bench.plot import PANEL_HEIGHT, PANEL_WIDTH, figure, legend, panel
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
PANELS = (("activation_mib_per_rank", "activation MiB per rank"), ("tokens_per_s", "tokens/s per replica"))
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#17becf"]


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
        world = dist.group.WORLD  # each timing the slowest rank's
        times = [seconds_per_step(lambda step=step: step().backward(), 1, world, device) for _ in range(args.repeats)]
        rows.append({"setup": name, "seq_len": length, "activation_mib_per_rank": group_max(saved, world, device) / MIB,
                     "tokens_per_s": args.batch * length / statistics.median(times)})  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(rows))


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
    print(table(rows), f"wrote {output} and {output.with_suffix('.svg')}", sep="\n")


if __name__ == "__main__":
    main()
