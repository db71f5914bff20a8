"""Auto-resume: with `ckpt_path=auto`, a rerun continues its previous run from that run's last checkpoint.

A run is the same command: the same overrides, `ckpt_path` aside. Under `parallel=auto` the number of devices is not
part of it either (`trainer.devices`, `trainer.num_nodes`): the command restarted on another number re-chooses the
layout and resumes (the checkpoint reshards, `tp_train.lightning.data_position` keeps the epoch's position)."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

import yaml

from tp_train.checkpoint.on_disk import newest_complete, saved_at

AUTO = "auto"
ENVIRONMENT_VARIABLE = "TP_TRAIN_RESUME_FROM"  # the launching process's decision, inherited by its child ranks
CHECKPOINTS = "checkpoints"  # in the run directory, where conf/callbacks saves them
FINISHED = "summary.json"
ELASTIC_KEYS = ("trainer.devices", "trainer.num_nodes")  # not part of a run's identity under parallel=auto
_INTERPOLATION = re.compile(r"\$\{[^}]*\}")


def resolve(
    ckpt_path: str | None, run_dir_template: str, run_dir: Path, overrides: list[str], elastic: bool = False
) -> str | None:
    """The checkpoint to resume from, or None to start fresh.

    Args:
        ckpt_path: the config value: "auto", None (fresh) or a path (used as it is).
        run_dir_template: the unresolved Hydra run directory (for a multirun, sweep dir / subdir).
        run_dir: this run's directory (Hydra has created it already).
        overrides: this run's task overrides (`hydra.overrides.task`).
        elastic: the layout is chosen for the devices (`parallel=auto`): a run on another number is the same run.
    """
    if ckpt_path != AUTO:
        return ckpt_path
    if ENVIRONMENT_VARIABLE in os.environ:  # a child rank: the launching process decided
        return os.environ[ENVIRONMENT_VARIABLE] or None
    found = last_checkpoint(run_dir_template, run_dir, overrides, elastic)
    return None if found is None else str(found)


def last_checkpoint(run_dir_template: str, run_dir: Path, overrides: list[str], elastic: bool = False) -> Path | None:
    """The last checkpoint of an unfinished earlier run of the same command (see the module docstring)."""
    command = _command(overrides, elastic)
    runs = {Path(p).resolve() for p in glob.glob(_INTERPOLATION.sub("*", run_dir_template))} | {run_dir.resolve()}
    events = []  # (time, checkpoint or None for "finished")
    for run in runs:
        recorded = run / ".hydra" / "overrides.yaml"
        if run != run_dir.resolve() and not (recorded.is_file() and _command(_read(recorded), elastic) == command):
            continue
        checkpoint, finished = newest_complete(run / CHECKPOINTS), run / FINISHED
        if checkpoint is not None:
            events.append((saved_at(checkpoint), checkpoint))
        if finished.is_file():
            events.append((finished.stat().st_mtime, None))
    return max(events, key=lambda event: event[0])[1] if events else None


def _command(overrides: list[str], elastic: bool = False) -> list[str]:
    ignored = ("ckpt_path", *(ELASTIC_KEYS if elastic else ()))
    return sorted(o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ignored)


def _read(path: Path) -> list[str]:
    try:
        return [str(item) for item in yaml.safe_load(path.read_text()) or []]
    except (OSError, yaml.YAMLError):
        return []  # not a run of this app: ignored
