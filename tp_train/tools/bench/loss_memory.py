"""`python -m tp_train.tools.bench.loss_memory`: the peak memory of one training step where the vocabulary is large
(GPT-2's 50,304 over 8 x 1024 tokens by default, under bf16 autocast): the plain model with `F.cross_entropy`
against ours sharded with the vocabulary-parallel loss, at each tp, per rank. The peak is the process's peak
resident set during the step (CPU: /proc/self/clear_refs, then VmHWM) or CUDA's peak allocated bytes, measured
on the second step (the first allocates AdamW's states). Contenders: plain, ours (the vocabulary-parallel loss on
the sharded logits) and fused (the head and the loss together, chunk by chunk). Prints one line per contender and
the ratios to plain, and writes them as JSON."""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models import GPT, GPTConfig
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.measure import group_max, peak_memory, reset_peak_memory
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB
from tp_train.tools.optimizer import adamw


def _plain_loss(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())  # as CausalLMModule: softmax in fp32


def _model(args, group, device, kind: str):
    """(The model, its forward and loss as one function of (inputs, targets)) for `kind`: "plain", "ours" (the
    vocabulary-parallel loss on sharded logits) or "fused" (the head and the loss together)."""
    config = GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width)  # fmt: skip
    torch.manual_seed(0)
    model = GPT(config).to(device)  # the same weights for every contender; ours keeps its shards of them
    if kind == "plain":
        return model, functools.partial(_plain_loss, model)
    parallelize(model, group, loss_parallel=True, device=device, verify=False)

    def sharded_loss(inputs, targets):
        return vocab_parallel_cross_entropy(model(inputs), targets, group, args.vocab, in_place_backward=True)

    def fused_loss(inputs, targets):
        with model.tp_loss_fusion.deferring() as fusion:
            hidden, head = fusion.take(model(inputs))
            return vocab_parallel_linear_cross_entropy(hidden, head.weight, targets, group, args.vocab)

    return model, fused_loss if kind == "fused" else sharded_loss


def measure_step(args, group, device, kind: str) -> tuple[int, float]:
    """(Peak bytes of the second training step on this rank, its loss)."""
    model, loss_fn = _model(args, group, device, kind)
    optimizer = adamw(model.parameters(), lr=1e-4)
    batch = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(1))
    batch = batch.to(device)
    peak = loss_value = 0
    for step in range(2):
        if step == 1:
            reset_peak_memory(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = loss_fn(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        peak, loss_value = peak_memory(device), loss.item()
    return peak, loss_value


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, kind: str, out: Path) -> None:
    if device.type == "cpu":  # glibc returns freed tensors' pages at once (M_MMAP_THRESHOLD = 1 MiB)
        ctypes.CDLL("libc.so.6").mallopt(-3, MIB)
    peak, loss = measure_step(args, dist.group.WORLD, device, kind)
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
    parser.add_argument("--contenders", default="plain,ours,fused", help="of plain, ours (sharded logits), fused")
    parser.add_argument("--output", default="loss_memory.json")
    args = parser.parse_args(argv)
    scratch = Path(args.output).with_suffix(".rank0.json")
    results = {}
    kinds = args.contenders.split(",")
    runs = [("plain", 1)] if "plain" in kinds else []
    runs += [(kind, int(tp)) for kind in kinds if kind != "plain" for tp in args.tp.split(",")]
    for kind, tp in runs:
        start_ranks(_rank, tp, args, kind, scratch)  # each contender in fresh processes: their own peaks
        results[f"{kind} tp={tp}"] = json.loads(scratch.read_text())
    scratch.unlink()
    plain = results.get("plain tp=1")
    for name, result in results.items():
        ratio = ""
        if plain is not None:
            result["ratio_to_plain"] = result["peak_bytes"] / plain["peak_bytes"]
            ratio = f"  x{result['ratio_to_plain']:.2f} of plain"
        print(f"{name:13} peak {result['peak_bytes'] / 2**30:6.2f} GiB per rank{ratio}  loss {result['loss']:.6f}")
    Path(args.output).write_text(json.dumps({"arguments": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
