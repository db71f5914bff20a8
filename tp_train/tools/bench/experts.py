"""`python -m tp_train.tools.bench.experts`: expert parallelism against tensor-parallel experts at the same rank
count, for Hugging Face's Mixtral built from a small config. Prints one table, writes JSON.

Contenders, each one training step (forward and backward) over the same global batch:
- one process: the whole model and batch.
- tp=N: today's tensor parallelism (`parallelize` with the family's plan): every rank takes the whole batch, the
  attention and every expert's matrices are split over the N ranks (`moe_tp_experts`), an all-reduce per attention
  and per MoE layer.
- ep=N: expert parallelism over N data-parallel ranks (`shard_experts`): each rank takes 1/N of the batch and holds
  1/N of each layer's experts whole; tokens travel to their experts' ranks and back (all-to-all), and the dense
  parameters' gradients are averaged over the ranks, as DDP would.

Measured per rank: the step's wall time (the slowest rank's, median of the measured steps), its peak (the growth of
the resident set over what the rank held before the step, gradients zeroed first), and the bytes it hands to
collectives per step (each collective's send buffer: an all-reduce's tensor, an all-to-all's input).
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

from tp_train.parallel.experts import shard_experts
from tp_train.parallel.experts.region import named_expert_parameters
from tp_train.plan.deciding.experts import find_experts
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.measure import (
    collective_bytes_per_step,
    current_memory,
    group_max,
    peak_memory,
    reset_peak_memory,
    return_freed_memory_at_once,
)
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB


def mixtral(args):
    from models.hf import hugging_face_causal_lm

    fields = dict(vocab_size=args.vocab, hidden_size=args.width, intermediate_size=args.expert_hidden,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                  num_local_experts=args.experts, num_experts_per_tok=args.top_k,
                  max_position_embeddings=args.seq)  # fmt: skip
    torch.manual_seed(0)
    return hugging_face_causal_lm("mixtral", config=fields)


def _measure(rank, world_size, device, setup, args, out):
    return_freed_memory_at_once(device, threshold=64 << 10)
    model = mixtral(args)
    model.to(device)
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)
    if setup == "tp" and world_size > 1:
        parallelize(model, group, verify=False)
    elif setup == "ep":
        shard_experts(model, find_experts(model), group, gradient_scale=1 / world_size)
        share = args.batch // world_size
        ids = ids[rank * share : (rank + 1) * share]
    experts = {id(param) for _, param, _ in named_expert_parameters(model)}
    dense = [param for param in model.parameters() if id(param) not in experts]

    def step():
        for param in model.parameters():
            param.grad = None
        logits = model(ids).logits
        F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        if setup == "ep" and world_size > 1:
            for param in dense:
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)

    step()  # warm-up
    sent = collective_bytes_per_step(step)
    seconds = []
    for index in range(args.steps):
        dist.barrier()
        before = current_memory(device)
        if index == 0:
            reset_peak_memory(device)
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        if index == 0:
            peak = peak_memory(device) - before
    wall = group_max(statistics.median(seconds), group, device)
    row = {"setup": "one process" if world_size == 1 else f"{setup}={world_size}", "ranks": world_size,
           "seconds": wall, "tokens_per_s": args.batch * args.seq / wall,
           "peak_mib_per_rank": group_max(peak, group, device) / MIB,
           "collective_mib_per_rank": group_max(sent, group, device) / MIB,
           "parameters_mib_per_rank": sum(p.numel() * p.element_size() for p in model.parameters()) / MIB}  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(row))


def table(rows: list[dict]) -> str:
    base = rows[0]
    lines = [
        "| setup | ranks | tokens/s | vs one process | step s | peak MiB / rank | parameters MiB / rank | "
        "collective MiB / rank / step |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['setup']} | {row['ranks']} | {row['tokens_per_s']:.0f} | "
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f} | {row['seconds']:.3f} | "
            f"{row['peak_mib_per_rank']:.1f} | {row['parameters_mib_per_rank']:.1f} | "
            f"{row['collective_mib_per_rank']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.experts", description=__doc__)
    parser.add_argument("--ranks", type=int, default=4, help="ranks of the tp and ep contenders")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="the global batch; ep ranks take 1/ranks of it each")
    parser.add_argument("--steps", type=int, default=3, help="measured steps; the median is reported")
    parser.add_argument("--output", default="bench_experts.json")
    args = parser.parse_args(argv)
    if args.batch % args.ranks or args.experts % args.ranks:
        raise SystemExit(f"--ranks {args.ranks} must divide --batch ({args.batch}) and --experts ({args.experts})")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for setup, ranks in (("one", 1), ("tp", args.ranks), ("ep", args.ranks)):
            out = Path(scratch) / "row.json"
            start_ranks(_measure, ranks, setup, args, str(out))
            rows.append(json.loads(out.read_text()))
    output = Path(args.output)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu, one thread per rank"
    output.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))
    print(table(rows), f"wrote {output}", sep="\n")


if __name__ == "__main__":
    main()
