"""`tests.train_cases.run`, which most `train.py` tests go through, answers as `python train.py` itself does: the same
status and output for the same command, the same losses with its child rank forked rather than started, and a run
past its timeout is killed and raised as subprocess.run raises."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import lightning as L
import pytest

from tests import train_cases
from tests.test_disk_full import losses
from tests.test_train_app import ROOT


class RecordCommandLine(L.Callback):
    """Writes each rank's interpreter command line (`sys.orig_argv`: a fork keeps its parent's) to `path`.rank<r>."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_start(self, trainer, pl_module) -> None:
        Path(f"{self.path}.rank{trainer.global_rank}").write_text(" ".join(sys.orig_argv))


@pytest.mark.slow
def test_a_forked_run_answers_as_python_train_py_does(tmp_path):
    command = [sys.executable, "train.py", "experiment=smoke", "logger=none", "tp=3", f"hydra.run.dir={tmp_path}"]
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    real = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    forked = train_cases.run(command, cwd=ROOT, env=env, timeout=300)
    assert real.returncode == forked.returncode == 2, (real.stderr[-2000:], forked.stderr[-2000:])
    assert real.stderr == forked.stderr and real.stdout == forked.stdout
    assert forked.stderr.startswith("error: ") and "tp=3" in forked.stderr, forked.stderr


@pytest.mark.slow  # waits out its 5-s limit, after the server's start when it is the worker's first run
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


@pytest.mark.slow
def test_a_forked_runs_child_rank_is_a_fork_and_trains_as_a_started_one(tmp_path):
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache"), "WANDB_MODE": "offline"}
    runs = {}
    started = partial(subprocess.run, capture_output=True, text=True)
    for how, run in (("started", started), ("forked", train_cases.run)):
        record = tmp_path / how / "argv"
        command = [sys.executable, "train.py", "experiment=smoke", "logger=csv", "tp=2", "trainer.max_steps=4",
                   "trainer.log_every_n_steps=1", "+callbacks.argv._target_=tests.test_train_cases.RecordCommandLine",
                   f"+callbacks.argv.path={record}", f"hydra.run.dir={tmp_path / how}"]  # fmt: skip
        result = run(command, cwd=ROOT, env=env, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[how] = losses(tmp_path / how), Path(f"{record}.rank1").read_text()
    assert len(runs["started"][0]) == 4 and runs["forked"][0] == runs["started"][0]
    assert "train.py" in runs["started"][1] and "--serve" in runs["forked"][1], runs
