"""Bad configs are refused by train.py before any rank starts: one line naming the key, the value and what would
work; exit status 2; no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CASES = {
    "ranks_not_multiple_of_tp": (["tp=3", "trainer.devices=2"], "trainer.devices=2 x trainer.num_nodes=1 = 2 ranks"),
    "unknown_precision": (["precision=fp8"], "precision=fp8 is not a precision; use one of 32, 16, bf16"),
    "heads_not_divisible": (["model.config.n_head=2", "tp=4"], "config.n_head=2 is not divisible by tensor_parallel"),
    "model_rejects_config": (["model.config.n_head=3", "tp=1"], "model: n_embd=64 must be a multiple of n_head=3"),
    "missing_data_path": (["data.source=./no/such/*.txt"], "data.source=./no/such/*.txt: no such file"),
    "sequence_longer_than_context": (["model.config.block_size=32"], "data.block_size=64 exceeds the model's context"),
}


def refusal(tmp_path, *overrides: str) -> tuple[str, subprocess.CompletedProcess]:
    """Runs `train.py experiment=smoke logger=none *overrides`, asserts it was refused (status 2, no traceback, one
    `error: ` line) and returns that line and the process."""
    result = subprocess.run(
        [sys.executable, "train.py", "experiment=smoke", "logger=none", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=ROOT, env={**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0], result


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_is_one_line_exit_2_no_traceback(case, tmp_path):
    overrides, expected = CASES[case]
    error, _ = refusal(tmp_path, *overrides)
    assert expected in error
    assert not (tmp_path / "cache").exists()  # refused before any data was prepared
