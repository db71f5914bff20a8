"""`python -m tp_train.tools.bench.verification`: what default plan verification costs in memory, per rank."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io

import torch

from models import GPT, GPTConfig
from tp_train.plan.checking.verify import SwapCheck
from tp_train.plan.probe_input import PROBE_TOKENS
from tp_train.tools.bench.measure import peak_memory, reset_peak_memory, return_freed_memory_at_once
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB

# The module (the package exports the function `tp_train.parallelize`).
SHARDING = importlib.import_module("tp_train.plan.parallelize")


class _MeasuredSwapCheck(SwapCheck):
    """`SwapCheck` that records the peak memory while the checks run, and the peak before each (so the peak of
    the whole `parallelize` survives the resets), above `baseline`, set before sharding."""

    baseline = checks = between = 0

    def __call__(self, name, module, layer):
        cls = _MeasuredSwapCheck
        cls.between = max(cls.between, peak_memory(self.device) - cls.baseline)
        reset_peak_memory(self.device)
        super().__call__(name, module, layer)
        cls.checks = max(cls.checks, peak_memory(self.device) - cls.baseline)


def _peak_while_sharding(config: GPTConfig, device: torch.device, verify: bool | None) -> tuple[int, int]:
    """(peak growth while `parallelize` runs, bytes of this rank's shards), for a model built on meta."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(config)
    reset_peak_memory(device)
    before = _MeasuredSwapCheck.baseline = peak_memory(device)
    _MeasuredSwapCheck.device = device
    with contextlib.redirect_stdout(io.StringIO()):  # verification's one line is not this report
        SHARDING.parallelize(model, device=device, verify=verify)
    peak = max(peak_memory(device) - before, _MeasuredSwapCheck.between, _MeasuredSwapCheck.checks)
    shards = sum(param.numel() * param.element_size() for param in model.parameters())
    del model
    return peak, shards


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    return_freed_memory_at_once(device)
    config = GPTConfig(vocab_size=args.vocab, block_size=1024, n_layer=args.layers, n_head=args.heads,
                       n_embd=args.width)  # fmt: skip
    _peak_while_sharding(config, device, verify=False)  # warm-up: allocator and autograd state, once
    unverified, shards = _peak_while_sharding(config, device, verify=False)
    SHARDING.SwapCheck = _MeasuredSwapCheck  # the same checks, measured
    verified, _ = _peak_while_sharding(config, device, verify=None)
    width, hidden = args.width, 4 * args.width
    block = (4 * width * width + 2 * width * hidden + 4 * width + hidden + 4 * width) * 4  # fp32, with norms
    activations = 2 * PROBE_TOKENS * max(hidden, args.vocab // world_size) * 4  # input, output, their grads
    bound = shards + block + activations
    checks = _MeasuredSwapCheck.checks
    if rank == 0:
        print(f"GPT {args.layers}x{width}, vocabulary {args.vocab}, tp={world_size}, per rank:")
        print(f"  shards                               {shards / MIB:8.1f} MiB")
        print(f"  peak while sharding, verify=False    {unverified / MIB:8.1f} MiB")
        print(f"  peak while sharding, verified        {verified / MIB:8.1f} MiB")
        print(f"  verification adds to that peak       {(verified - unverified) / MIB:8.1f} MiB")
        print(f"  peak while the per-module checks run {checks / MIB:8.1f} MiB")
        print(f"  bound: shards + one block's full weights {block / MIB:.1f} MiB + probe activations "
              f"{activations / MIB:.2f} MiB = {bound / MIB:.1f} MiB; checks / bound {checks / bound:.2f} "
              f"(target <= 1)")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.verification", description=__doc__)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (ranks)")
    parser.add_argument("--vocab", type=int, default=50257, help="vocabulary size (GPT-2's by default)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args(argv)
    start_ranks(_rank, args.tp, args)


if __name__ == "__main__":
    main()
