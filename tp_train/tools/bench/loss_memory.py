"""`python -m tp_train.tools.bench.loss_memory`: the peak memory of one training step where the vocabulary is large
(GPT-2's 50,304 over 8 x 1024 tokens by default, under bf16 autocast): the plain model with `F.cross_entropy`
against ours sharded with the vocabulary-parallel loss, at each tp, per rank. The peak is the process's peak
resident set during the step (CPU: /proc/self/clear_refs, then VmHWM) or CUDA's peak allocated bytes, measured
on the second step (the first allocates AdamW's states). Prints one line per contender and the ratios to plain,
and writes them as JSON."""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import GPT, GPTConfig
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.measure import group_max, peak_resident_bytes, reset_peak
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB


def _plain_loss(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # as CausalLMModule: softmax in fp32


def _model(args, group, device, ours: bool):
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).to(device)  # the same weights for every contender; ours keeps its shards of them
    if not ours:
        return model, _plain_loss
    parallelize(model, group, loss_parallel=True, device=device, verify=False)
    return model, lambda logits, targets: vocab_parallel_cross_entropy(
        logits, targets, group, args.vocab, in_place_backward=True
    )


def measure_step(args, group, device, ours: bool) -> tuple[int, float]:
    """(Peak bytes of the second training step on this rank, its loss)."""
    model, loss_fn = _model(args, group, device, ours)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = batch.to(device)
    peak = loss_value = 0
    for step in range(2):
        if step == 1:
            reset_peak(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(batch[:, :-1])
            loss = loss_fn(logits, batch[:, 1:])
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak, loss_value = peak_resident_bytes(device), loss.item()
    return peak, loss_value


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, kind: str, out: Path) -> None:
    if device.type == "cpu":  # glibc returns freed tensors' pages at once (M_MMAP_THRESHOLD = 1 MiB)
        ctypes.CDLL("libc.so.6").mallopt(-3, MIB)
    peak, loss = measure_step(args, dist.group.WORLD, device, kind != "plain")
    peak = int(group_max(peak, dist.group.WORLD, device))
    if rank == 0:
        out.write_text(json.dumps({"peak_bytes": peak, "loss": loss}))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.loss_memory", description=__doc__)
    parser.add_argument("--tp", default="1,2", help="tensor-parallel sizes of ours, comma-separated")
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--fused", action="store_true", help="ours with the fused head and loss")
    parser.add_argument("--output", default="loss_memory.json")
    args = parser.parse_args(argv)
    scratch = Path(args.output).with_suffix(".rank0.json")
    results = {}
    for kind, tp in [("plain", 1), *(("ours", int(tp)) for tp in args.tp.split(","))]:
        start_ranks(_rank, tp, args, kind, scratch)  # each contender in fresh processes: their own peaks
        results[f"{kind} tp={tp}"] = json.loads(scratch.read_text())
    scratch.unlink()
    plain = results["plain tp=1"]
    for name, result in results.items():
        result["ratio_to_plain"] = result["peak_bytes"] / plain["peak_bytes"]
        print(f"{name:12} peak {result['peak_bytes'] / 2**30:6.2f} GiB per rank  x{result['ratio_to_plain']:.2f} "
              f"of plain  loss {result['loss']:.6f}")  # fmt: skip
    Path(args.output).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
