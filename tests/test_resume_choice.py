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
    _checkpoint(checkpoints, "epoch=0-step=20.ckpt", now - 30)
    _checkpoint(checkpoints, "last.ckpt.tmp", now - 5)  # the save a full disk stopped: newer, not complete
    _checkpoint(checkpoints, "epoch=0-step=40.ckpt", now - 4, complete=False)  # killed mid-write
    os.symlink("epoch=0-step=40.ckpt", checkpoints / "last.ckpt")  # the link to it, made as the save began
    auto = resume.resolve("auto", str(run), run, [])
    print("chose", auto)
    assert auto == str(checkpoints / "epoch=0-step=20.ckpt")

    _checkpoint(checkpoints, "epoch=0-step=30.ckpt", now - 10)
    assert resume.resolve("auto", str(run), run, []) == str(checkpoints / "epoch=0-step=30.ckpt")
    (checkpoints / "last.ckpt").unlink()
    os.symlink("epoch=0-step=30.ckpt", checkpoints / "last.ckpt")  # one copy per save point: last is a link
    assert resume.resolve("auto", str(run), run, []) == str(checkpoints / "last.ckpt")  # the same save, by its name
    (run / "summary.json").write_text("{}")  # the run finished after its last save: start fresh
    assert resume.resolve("auto", str(run), run, []) is None
