"""Checkpoints and the disk under real `train.py` at tp=2: one copy per save point (`last.ckpt` is a link), and a
disk too small for the next checkpoint ends the run with one line, leaves the complete checkpoint as it was, and the
same command on a larger disk resumes from it with the losses of a run that never stopped."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import train_cases
from tp_train.app import resume
from tp_train.checkpoint.checks import check_files
from tp_train.checkpoint.safe_load import read_extra

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["experiment=smoke", "tp=2", "logger=csv", "data.max_files=20", "trainer.max_steps=40",
           "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
           "~callbacks.progress_bar"]  # fmt: skip


def _train(run_dir: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TP_TRAIN_CACHE": str(cache)}
    env.pop(resume.ENVIRONMENT_VARIABLE, None)
    return train_cases.run([sys.executable, "train.py", *COMMAND, f"hydra.run.dir={run_dir}", *extra], cwd=ROOT,
                           env=env, timeout=600)  # fmt: skip


def _bytes(path: Path) -> int:
    """Bytes of the files under `path`, links counted as links (not what they name)."""
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_symlink() or f.is_file())


def losses(run_dir: Path) -> dict[int, float]:
    """step -> train loss, from every CSV log of the run directory (a resumed run adds a version)."""
    losses = {}
    for metrics in sorted(run_dir.glob("csv/*/metrics.csv")):
        losses |= {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(metrics.open())
                   if row.get("train/loss")}  # fmt: skip
    return losses


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted run (and the data cache every run here shares)."""
    root = tmp_path_factory.mktemp("disk")
    result = _train(root / "straight", root / "cache")
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "straight", root / "cache"


@pytest.mark.slow
def test_one_copy_per_save_point(straight):
    run_dir, _ = straight
    checkpoints = run_dir / "checkpoints"
    (numbered,) = (path for path in checkpoints.iterdir() if not path.is_symlink())
    last = checkpoints / "last.ckpt"
    assert last.is_symlink() and last.resolve() == numbered.resolve()
    one, written = _bytes(numbered), _bytes(checkpoints)
    print(f"one checkpoint: {one} bytes; the save point's files: {written} bytes")
    assert written < one * 1.01  # the numbered checkpoint, and a link


def _mount_tmpfs(directory: Path, size: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    command = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        pytest.skip(f"a small real volume is needed and mounting a tmpfs failed: {result.stderr.strip()}")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux" or os.geteuid() != 0, reason="mounting a tmpfs needs root on Linux")
def test_a_full_disk_ends_the_run_in_one_line_and_the_same_command_resumes(straight, tmp_path):
    straight_dir, cache = straight
    (numbered,) = (path for path in (straight_dir / "checkpoints").iterdir() if not path.is_symlink())
    one = _bytes(numbered)
    run_dir = tmp_path / "small"
    _mount_tmpfs(run_dir, one * 3 // 2)
    try:
        full = _train(run_dir, cache)
        errors = [line for line in full.stderr.splitlines() if line.startswith("error: ")]
        print(full.returncode, errors)
        assert full.returncode == 1 and "Traceback" not in full.stderr, full.stderr[-3000:]
        assert len(errors) == 1 and "bytes free" in errors[0] and "stays the last complete" in errors[0], errors
        checkpoints = run_dir / "checkpoints"
        assert not list(checkpoints.glob("*.tmp")), list(checkpoints.iterdir())  # no temp directory left
        (kept,) = (path for path in checkpoints.iterdir() if (path / ".metadata").is_file() and not path.is_symlink())
        assert kept.name in errors[0] and str(checkpoints) in errors[0]
        check_files(kept)  # every file there, whole
        assert read_extra(kept / "meta.pt")["global_step"] == 20

        subprocess.run(["mount", "-o", f"remount,size={one * 4}", str(run_dir)], check=True)  # a larger disk
        resumed = _train(run_dir, cache)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        (line,) = (line for line in resumed.stderr.splitlines() if line.startswith("resuming from "))
        assert Path(line.split()[2].rstrip(",")).resolve() == kept.resolve(), line  # it, or last.ckpt linking it
        before, after = losses(straight_dir), losses(run_dir)
        print({step: (before[step], after[step]) for step in (20, 21, 39)})
        assert abs(after[20] - before[20]) <= 1e-5  # the first step after resuming
        assert all(abs(after[step] - before[step]) <= 1e-5 for step in range(40))
    finally:
        subprocess.run(["umount", "-l", str(run_dir)], capture_output=True)
