"""The benchmark's table and its targets, from the results `run.benchmark` collects."""

from __future__ import annotations

from tp_train.tools.bench.contenders import Contender

# Megatron's minimum per block and step: one all-reduce after attention and one after the MLP in forward, one
# for each of their input gradients in backward.
COLLECTIVES_PER_BLOCK = 4
# Outside the blocks: the embedding's all-reduce and the LM head's input-gradient all-reduce, then the loss over
# vocabulary-sharded logits: ours all-reduces the maximum and the sums, native's `loss_parallel()` as many.
COLLECTIVES_OUTSIDE_BLOCKS = 4


def table(results: list[dict]) -> str:
    header = (
        f"{'size':<7} {'contender':<22} {'step ms':>8} {'min ms':>7} {'tokens/s':>9} {'vs plain':>8} "
        f"{'native/ours':>11} {'comm ms':>7} {'peak MiB':>8} {'predicted':>9} {'state MiB':>9} {'coll/block':>10}"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        rows, size = result["contenders"], result["size"]
        plain = rows["plain tp=1"]["step_s"]
        for name, row in rows.items():
            native = _native(row, rows)
            speedup = f"{native['step_s'] / row['step_s']:.2f}x" if native else ""
            comm = f"{1000 * row['collective_s']:.1f}" if row["tp"] > 1 else "-"
            lines.append(
                f"{size['name']:<7} {name:<22} {1000 * row['step_s']:8.1f} {1000 * row['step_s_min']:7.1f} "
                f"{row['tokens_per_s']:9.0f} "
                f"{row['step_s'] / plain:7.2f}x {speedup:>11} {comm:>7} {row['peak_mib']:8.1f} "
                f"{row['predicted_peak_mib']:9.1f} {row['model_state_mib']:9.2f} {_per_block(row, size):>10}"
            )
    return "\n".join(lines)


def _native(row: dict, rows: dict) -> dict | None:
    """The native row an `ours` row is compared with (the same tp, compiled or not); None for variants."""
    if row["kind"] != "ours" or row["variant"]:
        return None
    return rows.get(Contender("native", row["tp"], compiled=row["compiled"]).name)


def _per_block(row: dict, size: dict) -> str:
    if row["tp"] == 1 or row["variant"] or row["compiled"]:
        return "-"  # under sequence parallelism, norm gradients add all-reduces of their own
    return f"{(row['collectives_per_step'] - COLLECTIVES_OUTSIDE_BLOCKS) / size['n_layer']:g}"


def targets(results: list[dict]) -> list[dict]:
    """Each target with its measured value and whether it is met (reported, never asserted)."""
    checks = []

    def check(name: str, value: float, limit: float, at_most: bool = True) -> None:
        met = value <= limit if at_most else value >= limit
        checks.append({"target": name, "value": round(value, 4), "limit": limit, "met": met})

    for index, result in enumerate(results):
        rows, size = result["contenders"], result["size"]["name"]
        for name, row in rows.items():
            if row["kind"] != "ours":
                continue
            native = _native(row, rows)
            if native:
                speedup = native["step_s"] / row["step_s"]
                check(f"{size}: native/ours step time at tp={row['tp']}", speedup, 1.25 if index == 0 else 1.0, False)
            if row["compiled"] or row.get("numerics", "fast") != "fast":
                continue  # the counters and the estimate are of eager steps in the fast numerics
            if row["tp"] > 1 and not row["variant"]:
                per_block = (row["collectives_per_step"] - COLLECTIVES_OUTSIDE_BLOCKS) / result["size"]["n_layer"]
                check(f"{size}: collectives per block per step at tp={row['tp']}", per_block, COLLECTIVES_PER_BLOCK)
            if row["tp"] > 1:
                ratio = row["tp_bytes_per_step"] / row["analytic_tp_bytes_per_step"]
                check(f"{size}: counted / analytic TP bytes at {name}", ratio, 1.0)
            off = abs(row["predicted_peak_mib"] / row["peak_mib"] - 1)
            check(f"{size}: predicted / measured peak at {name}", off, 0.15)
        ours_1 = rows.get("ours tp=1")
        if ours_1:
            check(f"{size}: ours tp=1 / plain step time", ours_1["step_s"] / rows["plain tp=1"]["step_s"], 1.03)
            for tp, limit in ((2, 0.55), (4, 0.30)):
                if f"ours tp={tp}" in rows:
                    ratio = rows[f"ours tp={tp}"]["model_state_mib"] / ours_1["model_state_mib"]
                    check(f"{size}: model state per rank tp={tp} / tp=1", ratio, limit)
        for tp in (1, 2):
            fast, invariant = rows.get(f"ours tp={tp}"), rows.get(f"ours tp={tp} invariant")
            if fast and invariant:
                check(
                    f"{size}: invariant / fast numerics step time at tp={tp}", invariant["step_s"] / fast["step_s"], 1.5
                )
        no_overlap = rows.get("ours tp=2 no overlap")
        if no_overlap and "ours tp=2" in rows and index == len(results) - 1:
            ratio = rows["ours tp=2"]["collective_s"] / no_overlap["collective_s"]
            check(f"{size}: time in TP collectives per step at tp=2, overlap / no overlap", ratio, 0.5)
        two_threads = rows.get("plain tp=1 x2 threads")
        if two_threads and "ours tp=2" in rows:
            ratio = rows["ours tp=2"]["step_s"] / two_threads["step_s"]
            check(f"{size}: ours tp=2 (1 thread/rank) / plain x2 threads step time", ratio, 1.10)
    return checks


def targets_text(checks: list[dict]) -> str:
    width = max(len(c["target"]) for c in checks)
    return "\n".join(
        f"  {'met ' if c['met'] else 'MISS'}  {c['target']:<{width}}  {c['value']:.3f} (limit {c['limit']})"
        for c in checks
    )
