"""A checkpoint path as a run prints it (`resuming from <run>/checkpoints/step000020.ckpt`) pastes back unquoted as
`python train.py ckpt_path=...`: new checkpoints are named without `=`, and an old `epoch=0-step=20.ckpt` path, which
Hydra's grammar refuses unquoted, is quoted for Hydra before it parses (tp_train.app.command_line)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate

from tests import train_cases
from tests.test_configs import _compose
from tp_train.app.command_line import hydra_quoted, quote_paths

ROOT = Path(__file__).resolve().parents[1]
OLD_NAMES = ["callbacks.checkpoint.filename=null", "callbacks.checkpoint.auto_insert_metric_name=true"]  # Lightning's


def test_checkpoints_are_named_without_equals_and_list_in_step_order(tmp_path):
    checkpoint = instantiate(_compose(tmp_path, []).callbacks.checkpoint)
    names = [Path(checkpoint.format_checkpoint_name({"epoch": torch.tensor(0), "step": torch.tensor(step)})).name
             for step in (9, 10, 200, 1000)]  # fmt: skip
    assert names == ["step000009.ckpt", "step000010.ckpt", "step000200.ckpt", "step001000.ckpt"]
    assert names == sorted(names)


def test_a_path_key_whose_value_hydra_refuses_for_its_equals_sign_is_quoted_and_nothing_else():
    old = "outputs/2026-11-28/10-00-00/checkpoints/epoch=0-step=20.ckpt"
    argv = ["train.py", "tp=2", f"ckpt_path={old}", "+model.path=/models/lr=1e-4", "data.source=/data/a=b/*.txt"]
    quote_paths(argv)
    assert argv == ["train.py", "tp=2", f"ckpt_path='{old}'", "+model.path='/models/lr=1e-4'",
                    "data.source=/data/a=b/*.txt"]  # fmt: skip
    kept = [
        ["train.py", f"ckpt_path='{old}'"],  # quoted already: Hydra reads it
        ["train.py", "ckpt_path=outputs/run/checkpoints/step000020.ckpt", "ckpt_path=auto", "ckpt_path=null"],
        ["train.py", "-m", f"ckpt_path={old},{old}"],  # a sweep over paths, perhaps: Hydra's own message
    ]
    for argv in kept:
        as_typed = list(argv)
        quote_paths(as_typed)
        assert as_typed == argv
    parser = OverridesParser.create()
    for value in ("it's=1", "a\\'b=1", "ends=\\", "a b/c=1", "${oc.env:HOME}/e=1"):
        assert parser.parse_override(f"ckpt_path={hydra_quoted(value)}").value() == value, value


def test_an_old_checkpoint_path_pasted_unquoted_reaches_the_app(tmp_path):
    """Hydra takes the value as the path: the app's own line about it (here, that it is not there), not Hydra's
    `mismatched input '='`."""
    old = tmp_path / "run" / "checkpoints" / "epoch=0-step=20.ckpt"
    result = _train(tmp_path, f"ckpt_path={old}", f"hydra.run.dir={tmp_path / 'again'}", check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors == [f"error: ckpt_path: checkpoint {old}: no such file or directory; use a checkpoint directory a "
                      f"run saved, e.g. <run dir>/checkpoints/last.ckpt"]  # fmt: skip


@pytest.mark.slow
def test_checkpoint_paths_as_runs_print_them_resume_pasted_unquoted(tmp_path):
    """A run saves under the old names (as tp_train did before), the same directory resumed with `ckpt_path=auto`
    prints that path and saves under the new names, and resumed again prints the new path (the newer of the two).
    Each printed path, pasted unquoted as `ckpt_path=...`, resumes: the old one at tp=2, whose ranks are started with
    the quoted override Hydra recorded."""
    run = tmp_path / "run"
    _train(tmp_path, *OLD_NAMES, "trainer.max_steps=2", f"hydra.run.dir={run}")
    (run / "summary.json").unlink()  # as a run stopped after its save leaves it: the next one resumes
    old = _resuming_from(_train(tmp_path, "trainer.max_steps=4", f"hydra.run.dir={run}"))
    assert old == run / "checkpoints" / "epoch=0-step=2.ckpt"
    (run / "summary.json").unlink()
    new = _resuming_from(_train(tmp_path, "trainer.max_steps=4", f"hydra.run.dir={run}"))
    assert new == run / "checkpoints" / "step000004.ckpt" and old.is_dir()

    for path, tp, steps in ((old, 2, 3), (new, 1, 5)):
        pasted = tmp_path / f"pasted-at-tp{tp}"
        result = _train(tmp_path, f"ckpt_path={path}", f"tp={tp}", f"trainer.max_steps={steps}",
                        f"hydra.run.dir={pasted}")  # fmt: skip
        assert _resuming_from(result) == path
        assert f"Restored all states from the checkpoint at {path}" in result.stderr  # Lightning loaded it
        summary = json.loads((pasted / "summary.json").read_text())
        assert summary["steps"] == steps and len(summary["peak_memory_mib_per_rank"]) == tp


def _train(tmp_path: Path, *overrides: str, check: bool = True):
    tiny = ["experiment=smoke", "tp=1", "logger=none", "data.max_files=20", "data.vocab_size=300", "data.block_size=32",
            "model.config.n_layer=1", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
            "callbacks.checkpoint.save_last=false", "+callbacks.checkpoint.save_top_k=-1"]  # fmt: skip
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    result = train_cases.run([sys.executable, "train.py", *tiny, *overrides], cwd=ROOT, env=env, timeout=300)
    assert not check or result.returncode == 0, result.stderr[-3000:]
    return result


def _resuming_from(result) -> Path:
    """The checkpoint of the run's `resuming from <path>[, ...]` line, as a user would copy it."""
    (line,) = (line for line in result.stderr.splitlines() if line.startswith("resuming from "))
    return Path(line.removeprefix("resuming from ").split(", ")[0])
