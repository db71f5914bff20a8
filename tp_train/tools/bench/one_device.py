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
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.distributed as dist

from models import GPT
from tp_train.tools.bench.contenders import SIZES, Contender, Size, TrainingStep, build
from tp_train.tools.bench.measure import peak_bytes, seconds_per_step, step_profile
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.memory import MIB, estimate_memory

GPT_SMALL = Size("gpt_small", n_layer=12, n_embd=768, n_head=12, batch=8, seq=1024, vocab=50304)
# Dense bf16 FLOP/s without sparsity, from NVIDIA's data sheets (half the "with sparsity" figure), by a name
# torch.cuda.get_device_name() contains, the most specific first: H100 SXM is "NVIDIA H100 80GB HBM3".
PEAK_BF16_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H200 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),  # SXM: the H100 SXM's compute with more and faster memory
    ("A100", 312e12),
]
CONTENDERS = [Contender(kind, 1, compiled=compiled) for compiled in (False, True) for kind in ("plain", "ours")]


def flops_per_token(size: Size) -> float:
    """6 N + 12 L H Q T (see the module docstring) for the GPT of `size`."""
    with torch.device("meta"):
        model = GPT(size.config())
    parameters = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    parameters -= model.pos_emb.weight.numel()
    return 6 * parameters + 12 * size.n_layer * size.n_embd * size.seq


def peak_flops(device_name: str | None) -> float | None:
    return next((flops for name, flops in PEAK_BF16_FLOPS if device_name and name in device_name), None)


def prepare(contender: Contender, size: Size, device: torch.device) -> tuple[TrainingStep, dict]:
    """(The contender's training step, built, compiled and warm; its row so far: peak memory and the estimate)."""
    start = time.perf_counter()
    step = build(contender, size, dist.group.WORLD, device)
    # Its forward, loss and backward under bf16 autocast, the optimizer step outside (Lightning's "bf16-mixed").
    step.context = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16)
    for _ in range(3):  # compiles (forward and backward), then warms the allocator and cuBLAS
        step()
    ready_s = time.perf_counter() - start
    peak = statistics.median(peak_bytes(step, device) for _ in range(3))
    with torch.device("meta"):
        meta_model = GPT(size.config())
    predicted = estimate_memory(
        meta_model, size.batch, size.seq, precision="bf16-mixed", loss_parallel=contender.kind == "ours"
    ).total
    row = {
        "peak_mib": peak / MIB,
        "predicted_peak_mib": predicted / MIB,
        "peak_over_predicted": peak / predicted,
        "seconds_to_first_timing": ready_s,  # build, compile and warm-up
    }
    return step, row


def timed_rounds(steps: dict[str, TrainingStep], rounds: int, seconds: float, device) -> dict[str, list[float]]:
    """Seconds per step of every contender, one timing each per round, the order reversed every other round (so
    neither always runs after the other: clocks and caches warm alike); each timing about `seconds` long."""
    group = dist.group.WORLD
    per_timing = {name: max(1, round(seconds / seconds_per_step(s, 1, group, device))) for name, s in steps.items()}
    times = {name: [] for name in steps}
    for index in range(rounds):
        for name in list(steps)[:: 1 if index % 2 == 0 else -1]:
            times[name].append(seconds_per_step(steps[name], per_timing[name], group, device))
    return times


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    size = GPT_SMALL if args.size == GPT_SMALL.name else SIZES[args.size]
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peak_flops(device_name)
    result = {
        "device": device_name or "cpu",
        "torch": torch.__version__,
        "size": asdict(size) | {"precision": "bf16-mixed", "optimizer": "AdamW (tools/optimizer.py: foreach on CUDA)"},
        "flops_per_token": flops_per_token(size),
        "mfu_formula": "tokens_per_s * (6 N + 12 L H Q T) / peak_flops; N: parameters less the position embedding",
        "peak_flops": peak,
        "rounds": args.rounds,
        "contenders": {},
        "ratios": {},  # the median over rounds of each round's ratio
        "ratio_ranges": {},  # [lowest, highest] of the rounds' ratios
    }
    steps = {}
    for contender in CONTENDERS:
        if contender.compiled and not args.compiled:
            continue
        try:
            steps[contender.name], result["contenders"][contender.name] = prepare(contender, size, device)
        except Exception as error:  # noqa: BLE001 - one contender failing still leaves the others' numbers
            result["contenders"][contender.name] = _error(error)
        _write(args.output, result)
    times = timed_rounds(steps, args.rounds, args.seconds, device)
    for name, seconds in times.items():
        row = result["contenders"][name]
        row |= {"step_s": statistics.median(seconds), "step_s_rounds": seconds}
        row["tokens_per_s"] = size.batch * size.seq / row["step_s"]
        row["mfu"] = row["tokens_per_s"] * result["flops_per_token"] / peak if peak else None
        print(f"{name}: {_line(row)}", flush=True)
    for name, (low, median, high) in ratios(times).items():
        result["ratios"][name], result["ratio_ranges"][name] = median, [low, high]
        print(f"{name}: {median:.3f} (median of {args.rounds} rounds; {low:.3f}-{high:.3f})")
    _write(args.output, result)
    result["profile"] = {name: step_profile(step, device) for name, step in steps.items()}
    for name, profile in result["profile"].items():
        print(f"{name}: {profile['busy_ms_per_step']:.1f} ms busy per step; top: {profile['top'][0]['name'][:60]}")
    _write(args.output, result)
    steps.clear()
    _release(device)
    result["sweep"] = micro_batch_sweep(args, size, device, peak, result)
    _write(args.output, result)
    print(f"wrote {args.output}")


def micro_batch_sweep(args: argparse.Namespace, size: Size, device: torch.device, peak, result: dict) -> dict:
    """Ours' MFU at each micro-batch of `--sweep` (tokens per sequence as the size's), compiled when the run
    compiles, one contender at a time (its own memory); with the size's own batch from the rounds, the best."""
    contender = Contender("ours", 1, compiled=args.compiled)
    rows = {size.batch: result["contenders"].get(contender.name, {}).get("mfu")}
    for batch in [int(b) for b in args.sweep.split(",") if b]:
        try:
            step, _ = prepare(contender, replace(size, batch=batch), device)
            seconds = statistics.median(timed_rounds({contender.name: step}, 3, args.seconds, device)[contender.name])
            rows[batch] = batch * size.seq / seconds * result["flops_per_token"] / peak if peak else None
            del step
        except Exception as error:  # noqa: BLE001 - out of memory at the largest batch still leaves the others
            rows[batch] = _error(error)["error"]
        _release(device)
        print(f"{contender.name} batch {batch} x {size.seq}: MFU {rows[batch]}", flush=True)
    measured = {batch: mfu for batch, mfu in rows.items() if isinstance(mfu, float)}
    best = max(measured, key=measured.get) if measured else None
    return {"contender": contender.name, "mfu_by_batch": rows, "best_batch": best, "best_mfu": measured.get(best)}


def ratios(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """(Lowest, median, highest) over rounds of ours over plain (eager, compiled) and compiled over eager (plain,
    ours) in tokens/s, each round's ratio from that round's two timings."""
    pairs = {f"ours/plain tokens_per_s{c}": (f"ours tp=1{c}", f"plain tp=1{c}") for c in ("", " compiled")}
    pairs |= {f"{k} compiled/eager tokens_per_s": (f"{k} tp=1 compiled", f"{k} tp=1") for k in ("plain", "ours")}
    out = {}
    for name, (numerator, denominator) in pairs.items():
        if numerator in times and denominator in times:
            rounds = [slow / fast for fast, slow in zip(times[numerator], times[denominator], strict=True)]
            out[name] = (min(rounds), statistics.median(rounds), max(rounds))
    return out


def _error(error: Exception) -> dict:
    return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-3000:]}


def _write(output: str, result: dict) -> None:
    Path(output).write_text(json.dumps(result, indent=1))  # after each phase: a run cut short keeps the rest


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


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
    parser.add_argument("--rounds", type=int, default=5, help="rounds of timings, the contenders alternated")
    parser.add_argument("--seconds", type=float, default=1.0, help="about how long one timing runs")
    parser.add_argument("--sweep", default="16,32", help="micro-batches for ours' MFU besides the size's own")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false", help="eager contenders only")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak bf16 TFLOP/s for MFU")
    start_ranks(_rank, 1, parser.parse_args(argv))


if __name__ == "__main__":
    main()
