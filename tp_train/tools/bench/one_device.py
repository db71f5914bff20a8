"""One device, one model at full size: tokens/s, MFU and peak memory of GPT-2 small (`conf/model/gpt_small.yaml`'s
shape) trained at tp=1 in bf16 autocast, the plain model against ours (`tp_train.parallelize`), eager and under
`torch.compile`, in one run (scripts/gpu_check.sh runs it on a GPU).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist

from models import GPT
from tp_train.tools.bench.contenders import SIZES, Contender, Size, build
from tp_train.tools.bench.measure import peak_bytes, seconds_per_step
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB, estimate_memory

GPT_SMALL = Size("gpt_small", n_layer=12, n_embd=768, n_head=12, batch=8, seq=1024, vocab=50304)
# Dense bf16 FLOP/s without sparsity, from NVIDIA's data sheets, by a name torch.cuda.get_device_name() contains.
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989e12, "H200": 989e12, "A100": 312e12}
CONTENDERS = [Contender(kind, 1, compiled=compiled) for compiled in (False, True) for kind in ("plain", "ours")]


def flops_per_token(size: Size) -> float:
    """6 N + 12 L H Q T (see the module docstring) for the GPT of `size`."""
    with torch.device("meta"):
        model = GPT(size.config())
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    parameters -= model.pos_emb.weight.numel()
    return 6 * parameters + 12 * size.n_layer * size.n_embd * size.seq


def peak_flops(device_name: str | None) -> float | None:
    matches = (flops for name, flops in PEAK_BF16_FLOPS.items() if device_name and name in device_name)
    return next(matches, None)  # the most specific name first


def measure(contender: Contender, size: Size, device: torch.device, repeats: int, seconds: float) -> dict:
    group = dist.group.WORLD
    start = time.perf_counter()
    step = build(contender, size, group, device)
    # Its forward, loss and backward under bf16 autocast, the optimizer step outside (Lightning's "bf16-mixed").
    step.context = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    for _ in range(3):  # compiles (forward and backward), then warms the allocator and cuBLAS
        step()
    ready_s = time.perf_counter() - start
    per_timing = max(1, round(seconds / seconds_per_step(step, 1, group, device)))
    times = [seconds_per_step(step, per_timing, group, device) for _ in range(repeats)]
    peak = statistics.median(peak_bytes(step, device) for _ in range(3))
    with torch.device("meta"):
        meta_model = GPT(size.config())
    predicted = estimate_memory(
        meta_model, size.batch, size.seq, precision="bf16-mixed", loss_parallel=contender.kind == "ours"
    ).total
    step_s = statistics.median(times)
    return {
        "step_s": step_s,
        "step_s_repeats": times,
        "tokens_per_s": size.batch * size.seq / step_s,
        "peak_mib": peak / MIB,
        "predicted_peak_mib": predicted / MIB,
        "peak_over_predicted": peak / predicted,
        "seconds_to_first_timing": ready_s,  # build, compile and warm-up
    }


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    size = GPT_SMALL if args.size == GPT_SMALL.name else SIZES[args.size]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device_name)
    result = {
        "device": device_name or "cpu",
        "torch": torch.__version__,
        "size": asdict(size) | {"precision": "bf16-mixed", "optimizer": "AdamW"},
        "flops_per_token": flops_per_token(size),
        "mfu_formula": "tokens_per_s * (6 N + 12 L H Q T) / peak_flops; N: parameters less the position embedding",
        "peak_flops": peak,
        "contenders": {},
        "ratios": {},
    }
    for contender in CONTENDERS:
        if contender.compiled and not args.compiled:
            continue
        try:
            row = measure(contender, size, device, args.repeats, args.seconds)
            row["mfu"] = row["tokens_per_s"] * result["flops_per_token"] / peak if peak else None
        except Exception as error:  # noqa: BLE001 - one contender failing still leaves the others' numbers
            row = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}
        result["contenders"][contender.name] = row
        result["ratios"] = ratios(result["contenders"])
        Path(args.output).write_text(json.dumps(result, indent=1))  # after each: a run cut short keeps the rest
        print(f"{contender.name}: {_line(row)}", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for name, value in result["ratios"].items():
        print(f"{name}: {value:.3f}")
    print(f"wrote {args.output}")


def ratios(rows: dict[str, dict]) -> dict[str, float]:
    """Ours over plain (eager, compiled) and compiled over eager (plain, ours), in tokens/s."""
    pairs = {f"ours/plain tokens_per_s{c}": (f"ours tp=1{c}", f"plain tp=1{c}") for c in ("", " compiled")}
    pairs |= {f"{k} compiled/eager tokens_per_s": (f"{k} tp=1 compiled", f"{k} tp=1") for k in ("plain", "ours")}
    out = {}
    for name, (numerator, denominator) in pairs.items():
        if "tokens_per_s" in rows.get(numerator, {}) and "tokens_per_s" in rows.get(denominator, {}):
            out[name] = rows[numerator]["tokens_per_s"] / rows[denominator]["tokens_per_s"]
    return out


def _line(row: dict) -> str:
    if "error" in row:
        return f"failed: {row['error'][:300]}"
    mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
    return (
        f"{row['tokens_per_s']:,.0f} tokens/s, step {1e3 * row['step_s']:.1f} ms, MFU {mfu}, peak "
        f"{row['peak_mib']:,.0f} MiB (predicted {row['predicted_peak_mib']:,.0f}, x{row['peak_over_predicted']:.2f})"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.bench.one_device", description=__doc__)
    parser.add_argument("--output", default="gpu_bench.json")
    parser.add_argument("--size", default=GPT_SMALL.name, choices=[GPT_SMALL.name, *SIZES], help="the model's shape")
    parser.add_argument("--repeats", type=int, default=5, help="timings per contender (the median is reported)")
    parser.add_argument("--seconds", type=float, default=1.0, help="about how long one timing runs")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false", help="eager contenders only")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s for MFU")
    start_ranks(_rank, 1, parser.parse_args(argv))


if __name__ == "__main__":
    main()
