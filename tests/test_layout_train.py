"""Every dimension at once, as users type it: `python train.py model=moe_tiny pp=2 tp=2 dp=2 ep=2` (8 ranks), with
DDP and with FSDP2 over the data-parallel ranks, equals the same command in one process at the same global batch
(`data.batch_size` x dp) over 10 AdamW steps: the logged losses, gradient norms and validation loss, and the final
parameters read back from the checkpoint each run saved (`tp_train.tools.export.export_lightning`), to 1e-5. A
checkpoint moves between the layouts: the FSDP2 run's step 5 resumes in one process, and the one process's at
pp=2 x dp=2 x ep=2, each with the unbroken run's next losses and final parameters."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests import train_cases
from tests.test_pipeline_train import _metrics
from tp_train.tools.export import export_lightning

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
COMMON = ["experiment=smoke", "model=moe_tiny", "logger=csv", "ckpt_path=null", f"trainer.max_steps={STEPS}",
          f"trainer.val_check_interval={STEPS // 2}", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
          "data.max_files=20", "+callbacks.checkpoint.save_top_k=-1"]  # fmt: skip
BATCH = 4  # per data-parallel rank
LAYOUTS = {
    "one process": ["tp=1", f"data.batch_size={2 * BATCH}"],
    "pp2 tp2 dp2 ep2": ["pp=2", "tp=2", "dp=2", "ep=2", f"data.batch_size={BATCH}"],
    "pp2 tp2 dp2 ep2 fsdp": ["pp=2", "tp=2", "dp=2", "ep=2", "data_parallel=fsdp", f"data.batch_size={BATCH}"],
    "pp2 dp2 ep2": ["pp=2", "dp=2", "ep=2", f"data.batch_size={BATCH}"],
}


def _saved(tmp_path: Path, run: str, step: int) -> Path:
    return tmp_path / run.replace(" ", "_") / "checkpoints" / f"step{step:06d}.ckpt"


def _train(tmp_path: Path, name: str, layout: str, ranks: int = 8, resume: Path | None = None):
    """The logged series of run `name` at `layout` and its final parameters, whole, from the checkpoint it saved."""
    out = tmp_path / name.replace(" ", "_")
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "train.py", *COMMON, *LAYOUTS[layout], f"hydra.run.dir={out}"]
    if resume is not None:
        command.append(f"ckpt_path={resume}")
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=600, child_ranks=ranks - 1)  # beside rank 0
    assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
    saved = out / "checkpoints" / f"step{STEPS:06d}.ckpt"
    whole = torch.load(export_lightning(saved, out / "whole.ckpt"), weights_only=False)["state_dict"]
    return _metrics(out), whole


@pytest.mark.slow
def test_moe_at_pp2_tp2_dp2_ep2_with_ddp_and_fsdp_equals_one_process(tmp_path):
    reference, reference_weights = _train(tmp_path, "one process", "one process", ranks=1)
    half = STEPS // 2
    runs = {  # name: (layout, ranks, the checkpoint it resumes, the first step it logs)
        "pp2 tp2 dp2 ep2": ("pp2 tp2 dp2 ep2", 8, None, 0),
        "pp2 tp2 dp2 ep2 fsdp": ("pp2 tp2 dp2 ep2 fsdp", 8, None, 0),
        "one process from fsdp": ("one process", 1, _saved(tmp_path, "pp2 tp2 dp2 ep2 fsdp", half), half),
        "pp2 dp2 ep2 from one process": ("pp2 dp2 ep2", 4, _saved(tmp_path, "one process", half), half),
    }
    gaps = {}
    for name, (layout, ranks, resume, first) in runs.items():
        series, weights = _train(tmp_path, name, layout, ranks, resume)
        for key in ("train/loss", "train/grad_norm", "val/loss"):
            expected = {step: value for step, value in reference[key].items() if step >= first}
            assert series[key].keys() == expected.keys(), (name, key)
            assert series[key] == pytest.approx(expected, abs=1e-5), (name, key)
        assert len(series["train/loss"]) == STEPS - first
        assert weights.keys() == reference_weights.keys(), name
        gaps[name] = max((weights[key] - reference_weights[key]).abs().max().item() for key in weights)
        assert gaps[name] < 1e-5, (name, gaps[name])
    print(gaps)
