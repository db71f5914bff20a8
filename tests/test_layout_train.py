"""Every dimension at once, as users type it: `python train.py model=moe_tiny pp=2 tp=2 dp=2 ep=2` (8 ranks), with
DDP and with FSDP2 over the data-parallel ranks, equals the same command in one process at the same global batch
(`data.batch_size` x dp) over 10 AdamW steps: the logged losses, gradient norms and validation loss, and the final
parameters read back from the checkpoint each run saved (`tp_train.tools.export.export_lightning`), to 1e-5."""

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
          f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1",
          "data.max_files=20"]  # fmt: skip
BATCH = 4  # per data-parallel rank
LAYOUTS = {
    "one process": ["tp=1", f"data.batch_size={2 * BATCH}"],
    "pp2 tp2 dp2 ep2": ["pp=2", "tp=2", "dp=2", "ep=2", f"data.batch_size={BATCH}"],
    "pp2 tp2 dp2 ep2 fsdp": ["pp=2", "tp=2", "dp=2", "ep=2", "data_parallel=fsdp", f"data.batch_size={BATCH}"],
}


def _train(tmp_path: Path, name: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The logged series of the layout `name` and its final parameters, whole, from the checkpoint it saved."""
    out = tmp_path / name.replace(" ", "_")
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "train.py", *COMMON, *LAYOUTS[name], f"hydra.run.dir={out}"]
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=600, child_ranks=7)  # 8 ranks: 7 beside rank 0
    assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
    saved = out / "checkpoints" / f"step{STEPS:06d}.ckpt"
    whole = torch.load(export_lightning(saved, out / "whole.ckpt"), weights_only=False)["state_dict"]
    return _metrics(out), whole


@pytest.mark.slow
def test_moe_at_pp2_tp2_dp2_ep2_with_ddp_and_fsdp_equals_one_process(tmp_path):
    reference, reference_weights = _train(tmp_path, "one process")
    gaps = {}
    for name in ("pp2 tp2 dp2 ep2", "pp2 tp2 dp2 ep2 fsdp"):
        series, weights = _train(tmp_path, name)
        for key in ("train/loss", "train/grad_norm", "val/loss"):
            assert series[key].keys() == reference[key].keys(), (name, key)
            assert series[key] == pytest.approx(reference[key], abs=1e-5), (name, key)
        assert len(series["train/loss"]) == STEPS
        assert weights.keys() == reference_weights.keys(), name
        gaps[name] = max((weights[key] - reference_weights[key]).abs().max().item() for key in weights)
        assert gaps[name] < 1e-5, (name, gaps[name])
    print(gaps)
