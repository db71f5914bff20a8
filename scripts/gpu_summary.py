"""The GPU check's last step: gathers what its phases left in OUT_DIR (versions.json, phases.tsv, gpu_bench.json,
cuda_tests.xml) into OUT_DIR/gpu_check.json, whatever is missing, and prints the summary table. Exit status 0 when
every phase passed."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def phases(out: Path) -> dict[str, dict]:
    rows = {}
    if (out / "phases.tsv").is_file():
        for line in (out / "phases.tsv").read_text().splitlines():
            name, status, seconds = line.split("\t")
            rows[name] = {"status": int(status), "seconds": int(seconds), "timed_out": status in ("124", "137")}
    return rows


def tests(out: Path) -> dict | None:
    """Each test's outcome from pytest's JUnit XML, and the counts."""
    try:
        root = ElementTree.parse(out / "cuda_tests.xml").getroot()
    except (OSError, ElementTree.ParseError):
        return None
    cases = {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                if tag == "skipped" and element.get("type") == "pytest.xfail":
                    outcome = "xfailed"  # an expected failure, written by JUnit as a skip with this type
                message = (element.get("message") or "")[:500]
        cases[name] = {"outcome": outcome, "seconds": float(case.get("time", 0)), "message": message}
    counts = {}
    for case in cases.values():
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return {"counts": counts, "cases": cases}


def table(summary: dict) -> str:
    lines = []
    versions = summary["versions"] or {}
    lines.append(f"device: {versions.get('gpu')}  torch {versions.get('torch')} (CUDA {versions.get('cuda')})")
    for name, phase in summary["phases"].items():
        state = "ok" if phase["status"] == 0 else ("TIMED OUT" if phase["timed_out"] else f"FAILED ({phase['status']})")
        lines.append(f"phase {name:<10} {state:<14} {phase['seconds']:>5} s")
    if summary["tests"]:
        counts = summary["tests"]["counts"]
        lines.append("tests: " + ", ".join(f"{count} {outcome}" for outcome, count in sorted(counts.items())))
        for name, case in summary["tests"]["cases"].items():
            lines.append(f"  {case['outcome']:<8} {case['seconds']:>6.1f} s  {name}")
            if case["outcome"] in ("failed", "error"):
                lines.append(f"           {case['message'][:300]}")
    bench = summary["bench"]
    if bench:
        size = bench["size"]
        lines.append(f"{size['name']}, tp=1, bf16-mixed, batch {size['batch']} x {size['seq']} tokens:")
        lines.append(f"  {'contender':<22} {'tokens/s':>10} {'MFU':>7} {'peak MiB':>10} {'predicted':>10} {'ratio':>6}")
        for name, row in bench["contenders"].items():
            if "error" in row:
                lines.append(f"  {name:<22} failed: {row['error'][:200]}")
                continue
            mfu = f"{100 * row['mfu']:.1f}%" if row.get("mfu") is not None else "n/a"
            lines.append(
                f"  {name:<22} {row['tokens_per_s']:>10,.0f} {mfu:>7} {row['peak_mib']:>10,.0f} "
                f"{row['predicted_peak_mib']:>10,.0f} {row['peak_over_predicted']:>6.2f}"
            )
        ranges = bench.get("ratio_ranges", {})
        for name, value in bench["ratios"].items():
            spread = f" (median of {bench['rounds']} rounds; {ranges[name][0]:.3f}-{ranges[name][1]:.3f})"
            lines.append(f"  {name}: {value:.3f}" + (spread if name in ranges else ""))
        for name, profile in bench.get("profile", {}).items():
            top = ", ".join(f"{row['name'][:40]} {row['ms_per_step']:.1f}" for row in profile["top"][:3])
            lines.append(f"  {name}: busy {profile['busy_ms_per_step']:.1f} ms per step; top ms: {top}")
        sweep = bench.get("sweep")
        if sweep:
            by_batch = ", ".join(
                f"{batch}: {100 * mfu:.1f}%" if isinstance(mfu, float) else f"{batch}: {mfu}"
                for batch, mfu in sweep["mfu_by_batch"].items()
            )
            best = f"{100 * sweep['best_mfu']:.1f}% at {sweep['best_batch']}" if sweep["best_mfu"] else "n/a"
            lines.append(f"  {sweep['contender']} MFU by micro-batch x {size['seq']}: {by_batch}; best {best}")
        lines.append(f"  MFU = {bench['mfu_formula']}; peak {bench['peak_flops']} FLOP/s")
    return "\n".join(lines)


def main() -> None:
    out = Path(sys.argv[1])
    summary = {
        "versions": _json(out / "versions.json"),
        "phases": phases(out),
        "tests": tests(out),
        "bench": _json(out / "gpu_bench.json"),
    }
    summary["passed"] = bool(summary["phases"]) and all(p["status"] == 0 for p in summary["phases"].values())
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    print("=" * 100)
    print(table(summary))
    print(f"wrote {out / 'gpu_check.json'}; {'every phase passed' if summary['passed'] else 'SOME PHASE FAILED'}")
    sys.exit(0 if summary["passed"] else 1)


if __name__ == "__main__":
    main()
