"""A tiny run of the benchmark (`python -m tp_train.tools.bench`), end to end: every contender is timed and measured."""

from __future__ import annotations

import json
from xml.etree import ElementTree

import pytest

from tests import train_cases

SVG = "{http://www.w3.org/2000/svg}"
CONTENDERS = ["plain tp=1", "ours tp=1", "native tp=1", "ours tp=2", "native tp=2", "ours tp=2 no overlap",
              "ours tp=2 +SP", "ours tp=2 +AC", "plain tp=1 x2 threads", "ours tp=1 invariant",
              "ours tp=2 invariant"]  # fmt: skip


def _bench(module: str, arguments: list[str]) -> str:
    """`python -m <module> <arguments>`'s stdout, run by the pytest worker's train.py server (tests.train_cases: the
    imports shared; the benchmark forks its ranks from the run as it does from the command)."""
    result = train_cases.run_module(module, arguments, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.slow
def test_bench_smoke_writes_every_contender(tmp_path):
    output = tmp_path / "bench.json"
    arguments = ["--sizes", "small", "--tp", "1,2", "--repeats", "1", "--seconds", "0", "--no-compiled", "--output",
                 str(output)]  # fmt: skip
    stdout = _bench("tp_train.tools.bench", arguments)
    assert "targets:" in stdout and "native/ours" in stdout
    report = json.loads(output.read_text())
    (size,) = report["results"]
    rows = size["contenders"]
    assert sorted(rows) == sorted(CONTENDERS)
    for name, row in rows.items():
        assert 0 < row["step_s"] < 60 and row["tokens_per_s"] > 0, (name, row)
        assert 0 < row["model_state_mib"] < row["peak_mib"] < 1000, (name, row)
        assert row["predicted_peak_mib"] > 0
    n_layer = size["size"]["n_layer"]
    # 4 per block; the embedding's forward and the head's input gradient; the vocab-parallel loss's max and sums.
    assert rows["ours tp=2"]["collectives_per_step"] == 4 * n_layer + 4
    assert rows["ours tp=1"]["collectives_per_step"] == 0
    for name in ("ours tp=2", "ours tp=2 no overlap", "ours tp=2 +SP", "ours tp=2 +AC"):
        assert rows[name]["tp_bytes_per_step"] == rows[name]["analytic_tp_bytes_per_step"] > 0, name
    # The profiler sees this thread's time in collectives: ours' own ranges, native's functional collectives.
    for name in ("ours tp=2", "native tp=2"):
        assert rows[name]["collective_s"] > 0 and 0 < rows[name]["collective_share"] < 1, (name, rows[name])
    assert rows["ours tp=1"]["collective_s"] == 0
    assert rows["ours tp=2"]["model_state_mib"] < 0.55 * rows["ours tp=1"]["model_state_mib"]
    assert {check["target"] for check in report["targets"]} and report["machine"]["cpus"] >= 1
    ratios = [check for check in report["targets"] if "invariant / fast numerics step time" in check["target"]]
    assert len(ratios) == 2 and all(check["value"] > 1 for check in ratios), ratios  # what the same bits cost
    plot = ElementTree.parse(output.with_suffix(".svg")).getroot()  # written beside the JSON by default
    titles = {line.findtext(f"{SVG}title") for line in plot.iter(f"{SVG}polyline")}
    assert titles == {"ours small", "native small", "plain small"}, titles


def _row(kind: str, tp: int, step_ms: float, peak_mib: float, compiled=False, variant="") -> dict:
    return {"kind": kind, "tp": tp, "step_s": step_ms / 1000, "peak_mib": peak_mib, "compiled": compiled,
            "variant": variant}  # fmt: skip


def test_the_plot_draws_step_time_and_memory_against_tp_for_each_kind_and_size(tmp_path):
    """The plot from a report: per panel one line per (kind, size) through every tp it ran, eager rows without a
    variant only; its points sit where the values are (higher step time, higher on the page)."""
    from tp_train.tools.bench.plot import main

    results = []
    for size, scale in (("small", 1), ("large", 10)):
        rows = [_row("plain", 1, 20 * scale, 14 * scale), _row("ours", 1, 21 * scale, 14 * scale),
                _row("ours", 2, 40 * scale, 8 * scale), _row("native", 2, 90 * scale, 9 * scale),
                _row("ours", 2, 30 * scale, 8 * scale, compiled=True), _row("ours", 2, 80 * scale, 6, variant="+AC"),
                _row("ours", 4, 110 * scale, 5 * scale), _row("native", 4, 250 * scale, 6 * scale)]  # fmt: skip
        contenders = {f"{row['kind']} {row['tp']} {row['compiled']} {row['variant']}": row for row in rows}
        results.append({"size": {"name": size}, "contenders": contenders})
    (tmp_path / "bench.json").write_text(json.dumps({"machine": {"cpus": 2, "torch": "x"}, "results": results}))
    main([str(tmp_path / "bench.json"), str(tmp_path / "bench.svg")])
    lines = list(ElementTree.parse(tmp_path / "bench.svg").getroot().iter(f"{SVG}polyline"))
    names = [line.findtext(f"{SVG}title") for line in lines]
    expected = sorted(f"{kind} {size}" for kind in ("native", "ours", "plain") for size in ("large", "small"))
    assert sorted(names[:6]) == sorted(names[6:]) == expected  # two panels: step time, then memory
    points = {name: [tuple(map(float, p.split(","))) for p in line.get("points").split()]
              for name, line in zip(names[:6], lines[:6], strict=True)}  # fmt: skip
    assert len(points["ours small"]) == 3 and len(points["native small"]) == 2 and len(points["plain large"]) == 1
    xs = [x for x, _ in points["ours small"]]
    assert xs == sorted(xs) and xs[0] < xs[1] < xs[2]  # tp 1, 2, 4 left to right
    assert points["native small"][0][1] < points["ours small"][1][1]  # slower is higher (smaller y)
    assert points["ours large"][0][1] < points["ours small"][0][1]


@pytest.mark.slow
def test_data_parallel_bench_smoke_compares_ddp_and_fsdp(tmp_path):
    output = tmp_path / "bench_dp.json"
    arguments = ["--sizes", "small", "--repeats", "1", "--steps", "1", "--output", str(output)]
    assert "ours dp2 x tp2 fsdp" in _bench("tp_train.tools.bench.data_parallel", arguments)
    ((size),) = json.loads(output.read_text())
    ddp, fsdp = size["contenders"]["ddp"], size["contenders"]["fsdp"]
    for row in (ddp, fsdp):
        assert 0 < row["step_s"] < 60
        assert row["model_state_mib"] == pytest.approx(row["predicted_state_mib"], rel=0.05)
    assert fsdp["model_state_mib"] < 0.55 * ddp["model_state_mib"]


@pytest.mark.slow
def test_checkpoint_bench_smoke_times_sync_and_async_saves(tmp_path):
    output = tmp_path / "bench_checkpoint.json"
    arguments = ["--n-layer", "1", "--n-embd", "64", "--n-head", "2", "--vocab", "256", "--seq", "16",
                 "--repeats", "1", "--steps", "1", "--directory", str(tmp_path / "checkpoints"),
                 "--output", str(output)]  # fmt: skip
    stdout = _bench("tp_train.tools.bench.checkpoint", arguments)
    assert "blocked by a save, async / sync" in stdout
    modes = json.loads(output.read_text())["modes"]
    for row in modes.values():
        assert 0 < row["blocked_s"] <= row["complete_s"] < 60 and row["step_s"] > 0, row
    assert not (tmp_path / "checkpoints").exists()  # the benchmark's checkpoints are removed
