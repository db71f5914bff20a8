"""`ckpt_path=auto` takes the newest complete checkpoint of the run, whatever its name: never a `*.tmp` (a save
killed or out of disk), never a directory without DCP's `.metadata`, a link followed to what it names."""

from __future__ import annotations

import os
import time
from pathlib import Path

from tp_train.app import resume


def _checkpoint(directory: Path, name: str, saved: float, complete: bool = True) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    for file in (".metadata", "meta.pt") if complete else ("__0_0.distcp",):
        (path / file).write_text("")
        os.utime(path / file, (saved, saved))
    return path


def test_auto_takes_the_newest_complete_checkpoint_whatever_its_name(tmp_path, monkeypatch):
    monkeypatch.delenv(resume.ENVIRONMENT_VARIABLE, raising=False)
    run, now = tmp_path / "run", time.time()
    checkpoints = run / "checkpoints"
    _checkpoint(checkpoints, "step000020.ckpt", now - 30)
    _checkpoint(checkpoints, "last.ckpt.tmp", now - 5)  # the save a full disk stopped: newer, not complete
    _checkpoint(checkpoints, "step000040.ckpt", now - 4, complete=False)  # killed mid-write
    os.symlink("step000040.ckpt", checkpoints / "last.ckpt")  # the link to it, made as the save began
    auto = resume.resolve("auto", str(run), run, [])
    print("chose", auto)
    assert auto == str(checkpoints / "step000020.ckpt")

    _checkpoint(checkpoints, "step000030.ckpt", now - 10)
    assert resume.resolve("auto", str(run), run, []) == str(checkpoints / "step000030.ckpt")
    (checkpoints / "last.ckpt").unlink()
    os.symlink("step000030.ckpt", checkpoints / "last.ckpt")  # one copy per save point: last is a link
    assert resume.resolve("auto", str(run), run, []) == str(checkpoints / "last.ckpt")  # the same save, by its name
    (run / "summary.json").write_text("{}")  # the run finished after its last save: start fresh
    assert resume.resolve("auto", str(run), run, []) is None


def test_auto_chooses_among_old_and_new_names_by_when_each_was_saved(tmp_path, monkeypatch):
    """A run directory with checkpoints named as tp_train named them before (`epoch=0-step=20.ckpt`, Lightning's
    default) and as now (`step000040.ckpt`), as one reused with `hydra.run.dir` holds: the newest complete one is
    taken, whichever name sorts first."""
    monkeypatch.delenv(resume.ENVIRONMENT_VARIABLE, raising=False)
    run, now = tmp_path / "run", time.time()
    checkpoints = run / "checkpoints"
    old = _checkpoint(checkpoints, "epoch=0-step=20.ckpt", now - 30)
    new = _checkpoint(checkpoints, "step000040.ckpt", now - 20, complete=False)  # killed mid-write
    assert resume.resolve("auto", str(run), run, []) == str(old)
    (new / ".metadata").write_text("")
    os.utime(new / ".metadata", (now - 10, now - 10))
    assert resume.resolve("auto", str(run), run, []) == str(new)
    newer_old = _checkpoint(checkpoints, "epoch=1-step=60.ckpt", now - 5)  # sorts before step000040.ckpt
    assert resume.resolve("auto", str(run), run, []) == str(newer_old)
