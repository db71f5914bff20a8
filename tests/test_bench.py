"""A tiny run of the benchmark (`python -m tp_train.tools.bench`), end to end: every contender is timed and measured."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.test_train_app import ROOT

CONTENDERS = ["plain tp=1", "ours tp=1", "native tp=1", "ours tp=2", "native tp=2", "ours tp=2 no overlap",
              "ours tp=2 +SP", "ours tp=2 +AC", "plain tp=1 x2 threads"]  # fmt: skip


@pytest.mark.slow
def test_bench_smoke_writes_every_contender(tmp_path):
    output = tmp_path / "bench.json"
    command = [sys.executable, "-m", "tp_train.tools.bench", "--sizes", "small", "--tp", "1,2", "--repeats", "1",
               "--seconds", "0", "--no-compiled", "--output", str(output)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "targets:" in result.stdout and "native/ours" in result.stdout
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


@pytest.mark.slow
def test_data_parallel_bench_smoke_compares_ddp_and_fsdp(tmp_path):
    output = tmp_path / "bench_dp.json"
    command = [sys.executable, "-m", "tp_train.tools.bench.data_parallel", "--sizes", "small", "--repeats", "1",
               "--steps", "1", "--output", str(output)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ours dp2 x tp2 fsdp" in result.stdout
    ((size),) = json.loads(output.read_text())
    ddp, fsdp = size["contenders"]["ddp"], size["contenders"]["fsdp"]
    for row in (ddp, fsdp):
        assert 0 < row["step_s"] < 60
        assert row["model_state_mib"] == pytest.approx(row["predicted_state_mib"], rel=0.05)
    assert fsdp["model_state_mib"] < 0.55 * ddp["model_state_mib"]


@pytest.mark.slow
def test_checkpoint_bench_smoke_times_sync_and_async_saves(tmp_path):
    output = tmp_path / "bench_checkpoint.json"
    command = [sys.executable, "-m", "tp_train.tools.bench.checkpoint", "--n-layer", "1", "--n-embd", "64",
               "--n-head", "2", "--vocab", "256", "--seq", "16", "--repeats", "1", "--steps", "1",
               "--directory", str(tmp_path / "checkpoints"), "--output", str(output)]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "blocked by a save, async / sync" in result.stdout
    modes = json.loads(output.read_text())["modes"]
    for row in modes.values():
        assert 0 < row["blocked_s"] <= row["complete_s"] < 60 and row["step_s"] > 0, row
    assert not (tmp_path / "checkpoints").exists()  # the benchmark's checkpoints are removed
