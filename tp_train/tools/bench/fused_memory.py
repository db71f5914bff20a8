"""`python -m tp_train.tools.bench.fused_memory`: what the fused head and loss (`vocab_parallel_linear_cross_entropy`)
hold while they run forward and backward, at several token counts (GPT-2 small's head by default: 768 wide, 50,304
columns, under bf16 autocast, one rank). "Peak memory of head + loss grows with the chunk, not with the sequence"
is measured as:

- raw peak: the largest sum of tensor bytes allocated since the op started and not yet freed, over its forward and
  backward (torch.profiler's allocator events: every allocation and free of a tensor on the device);
- working memory: the same peak less the two gradients it returns (the input's, tokens x hidden in the input's
  dtype, and the weight's), counted from the moment backward has allocated them (the end of its
  `RETURNED_GRADIENTS` profiler range, its first allocations); before that nothing is subtracted, nor at all when
  that range allocated anything but exactly those bytes.

Its inputs (hidden, weight, target) exist before it starts and are not counted. What stays in the working memory is
the head in the compute dtype, one chunk's logits and their gradient, one chunk's input-gradient and
weight-gradient products, and per-token fp32 statistics (4 bytes each: the target logit, max, sum of exps and the
log-sum-exp backward needs); a full-sequence fp32 logits buffer would be tokens x columns x 4 bytes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from tp_train.parallel.fused_cross_entropy import RETURNED_GRADIENTS, vocab_parallel_linear_cross_entropy
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB


def fused_memory(tokens: int, hidden: int, columns: int, chunk: int | None, autocast: bool, device) -> dict:
    """Raw peak and working memory (bytes, see the module docstring) of one forward and backward of the fused head
    and loss over `tokens` tokens, on this rank of the default group (one rank: the whole head)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(tokens, hidden, generator=generator).to(device).requires_grad_()
    weight = (torch.randn(columns, hidden, generator=generator) / hidden**0.5).to(device).requires_grad_()
    target = torch.randint(0, columns, (tokens,), generator=generator).to(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities, profile_memory=True) as prof:  # CPU's events: the marker (and CPU memory)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            group = dist.group.WORLD
            loss = vocab_parallel_linear_cross_entropy(inputs, weight, target, group, columns, chunk_size=chunk)
        loss.backward()
    returned = inputs.grad.nbytes + weight.grad.nbytes
    events = prof.profiler.kineto_results.events()
    [(begin, end)] = [(event.start_ns(), event.end_ns()) for event in events if event.name() == RETURNED_GRADIENTS]
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    allocations = [event for event in events if event.name() == "[memory]" and event.device_type() == kind]
    # Subtracted only when the range made exactly the returned gradients' bytes: anything else it made counts.
    gradients_first = sum(event.nbytes() for event in allocations if begin <= event.start_ns() <= end) == returned
    running = raw = working = made = 0
    for event in sorted(allocations, key=lambda event: event.start_ns()):
        running += event.nbytes()  # negative for a free
        if gradients_first and begin <= event.start_ns() <= end:
            made += event.nbytes()  # the returned gradients made so far
        raw = max(raw, running)
        working = max(working, running - made)
    return {
        "tokens": tokens,
        "raw_peak_bytes": raw,
        "returned_gradients_bytes": returned,
        "working_bytes": working,
        "gradients_allocated_first": gradients_first,
        "full_fp32_logits_bytes": tokens * columns * 4,
        "loss": loss.item(),
    }


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    rows = [
        fused_memory(tokens, args.hidden, args.columns, args.chunk, not args.fp32, device)
        for tokens in (int(count) for count in args.tokens.split(","))
    ]
    for row in rows:
        row["working_over_first"] = row["working_bytes"] / rows[0]["working_bytes"]
        row["raw_over_first"] = row["raw_peak_bytes"] / rows[0]["raw_peak_bytes"]
        print(
            f"{row['tokens']:>7} tokens: working {row['working_bytes'] / MIB:8.1f} MiB"
            f" (x{row['working_over_first']:.3f})"
            f"  raw peak {row['raw_peak_bytes'] / MIB:8.1f} MiB (x{row['raw_over_first']:.3f})"
            f"  returned gradients {row['returned_gradients_bytes'] / MIB:.1f} MiB"
            f"  (full fp32 logits: {row['full_fp32_logits_bytes'] / MIB:,.0f} MiB)"
        )
    Path(args.output).write_text(json.dumps({"arguments": vars(args), "results": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.fused_memory", description=__doc__)
    parser.add_argument("--tokens", default="8192,32768", help="token counts, comma-separated (8 x 1024, 8 x 4096)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--columns", type=int, default=50304, help="the vocabulary")
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: 32 MiB of fp32 logits)")
    parser.add_argument("--fp32", action="store_true", help="without bf16 autocast")
    parser.add_argument("--output", default="fused_memory.json")
    start_ranks(_rank, 1, parser.parse_args(argv))


if __name__ == "__main__":
    main()
