"""`tests.train_cases.run`, which most `train.py` tests go through, answers as `python train.py` itself does: the same
status and output for the same command, and a run past its timeout is killed and raised as subprocess.run raises."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests import train_cases
from tests.test_train_app import ROOT


def test_a_forked_run_answers_as_python_train_py_does(tmp_path):
    command = [sys.executable, "train.py", "experiment=smoke", "logger=none", "tp=3", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    real = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    forked = train_cases.run(command, cwd=ROOT, env=env, timeout=300)
    assert real.returncode == forked.returncode == 2, (real.stderr[-2000:], forked.stderr[-2000:])
    assert real.stderr == forked.stderr and real.stdout == forked.stdout
    assert forked.stderr.startswith("error: ") and "tp=3" in forked.stderr, forked.stderr


def test_a_forked_run_past_its_timeout_is_killed_and_raised(tmp_path):
    command = [sys.executable, "train.py", "experiment=smoke", "logger=none", "trainer.max_steps=100000",
               f"hydra.run.dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        train_cases.run(command, cwd=ROOT, env=env, timeout=5)
    assert time.monotonic() - started < 60
    after = train_cases.run([sys.executable, "train.py", "tp=3", f"hydra.run.dir={tmp_path}/next"], cwd=ROOT,
                            env=env, timeout=300)  # fmt: skip
    assert after.returncode == 2  # the server answers the next run
