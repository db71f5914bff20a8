"""Ways to start the ranks: the spawn start method (torchrun and SLURM: tests/test_cluster_launch.py). Each runs in
a subprocess with a timeout, so a launch that hangs fails the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(command: list[str], timeout: float = 300, **env: str) -> str:
    result = subprocess.run(
        command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **env}, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
def test_spawn_start_method_trains_and_the_main_process_survives():
    out = _run([sys.executable, "tests/scripts/fit_spawn.py"])
    losses = json.loads(next(line for line in out.splitlines() if line.startswith("LOSSES"))[len("LOSSES ") :])
    assert len(losses) == 3 and all(loss > 0 for loss in losses)


# torchrun itself (single agent with restarts, two agents as two nodes) and SLURM: tests/test_cluster_launch.py
