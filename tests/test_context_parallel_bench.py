"""The context-parallel benchmark runs end to end on gloo ranks, writes its JSON and SVG, and measures cp=2's peak per
rank (the process's peak resident set during the step) well under one process's SDPA on the whole sequence."""

from __future__ import annotations

import json

import pytest

from tests import train_cases


@pytest.mark.slow
def test_cp2_measured_peak_per_rank_is_below_one_process(tmp_path):
    output = tmp_path / "cp.json"
    # 4,096 tokens: at 2,048 a rank's peak is within what the process already holds, and read 0.0 MiB once in CI.
    # Run as its command, forked from the worker's train.py server: in the pytest worker itself the one-process
    # step fit in memory earlier tests had left resident (0 MiB read in both of 2026-12-07's clean-clone runs).
    arguments = ["--lengths", "4096", "--setups", "sdpa,cp=2 ring,cp=2 ring masked", "--output", str(output)]
    result = train_cases.run_module("tp_train.tools.bench.context_parallel", arguments, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    assert output.with_suffix(".svg").read_text().startswith("<svg")
    peak = {row["setup"]: row["peak_mib_per_rank"] for row in rows}
    if peak["sdpa"] == 0:  # read in CI when the step ran in the pytest worker (2026-11-29, 2026-12-07)
        pytest.skip("one process's SDPA peak read 0 MiB: no reference to compare with")
    # At 4,096 tokens the ratio measured 0.63-0.71 (0.52 at 16k, docs/long-sequences.md); a ring holding a block of
    # scores again would hold 8 heads x 2,048^2 fp32 = 128 MiB, over 5x one process's peak.
    assert peak["cp=2 ring"] <= 0.85 * peak["sdpa"], peak
    assert peak["cp=2 ring masked"] <= 1.2 * peak["cp=2 ring"] + 1.0, peak  # 1 MiB: the resident set's granularity
    assert "| cp=2 ring | 4096 |" in result.stdout
