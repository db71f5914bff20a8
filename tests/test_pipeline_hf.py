"""Hugging Face decoder LMs at `python train.py model=hf pp=N` as users type it, against the same run in one process
(losses, validation losses and gradient norms as train.py's CSV logger writes them, to 1e-5):
- GPT-2 (tied embeddings, the first and last stage each holding the tie) at pp=2 and at pp=2 x tp=2, the latter
  saved at its step 3 and resumed from that checkpoint at pp=1 x tp=1 and at pp=4 x tp=1 (1F1B over 4 stages of one
  block each), every next loss the one process's, which takes the weights and the optimizer's state resharded
  across stages and tensor-parallel shards by their names; the pp=2 checkpoint exported (`tp-train-export`) holds
  every stage's weights;
- Llama (untied, 4 blocks) at pp=2, at pp=2 x tp=2 and at pp=2 with 2 virtual stages per rank (Interleaved1F1B).
Dropout is off: a pipeline draws its masks stage by stage, not in one process's order."""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests import train_cases
from tp_train.tools.export import export_hugging_face

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["experiment=smoke", "logger=csv", "model=hf", "trainer.limit_val_batches=1",
          "trainer.num_sanity_val_steps=0", "trainer.log_every_n_steps=1"]  # fmt: skip
GPT2 = ["model.type=gpt2", "model.config.n_layer=4", "+model.config.resid_pdrop=0", "+model.config.embd_pdrop=0",
        "+model.config.attn_pdrop=0", "trainer.max_steps=6", "trainer.val_check_interval=3",
        "+callbacks.checkpoint.save_top_k=-1"]  # fmt: skip
LLAMA = ["model.type=llama", "model.config.n_layer=4", "trainer.max_steps=2", "trainer.val_check_interval=2"]
# two stages per rank, each a view of the one model (Llama's rotary embedding and mask computed on every stage)
VIRTUAL = ["trainer.strategy.pipeline_schedule=interleaved_1f1b", "trainer.strategy.pipeline_virtual_stages=2"]


def _train(tmp_path: Path, name: str, overrides: list[str]) -> dict[str, dict[int, float]]:
    """Runs train.py with `overrides` into tmp_path/name; returns its logged series: name -> step -> value."""
    out = tmp_path / name
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "train.py", *COMMON, *overrides, f"hydra.run.dir={out}"]
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, f"{name}: {result.stderr[-4000:]}"
    series: dict[str, dict[int, float]] = {}
    with open(next(out.glob("csv/version_*/metrics.csv"))) as file:
        for row in csv.DictReader(file):
            for key in ("train/loss", "val/loss", "train/grad_norm"):
                if row.get(key):
                    series.setdefault(key, {})[int(row["step"])] = float(row[key])
    return series


def _assert_same(run: dict, reference: dict, what: str, from_step: int = 0) -> float:
    """`run`'s series equal `reference`'s at every step `run` logged from `from_step` on; returns the largest gap."""
    gap = 0.0
    for key in ("train/loss", "val/loss", "train/grad_norm"):
        steps = [step for step in run.get(key, {}) if step >= from_step]
        assert steps, f"{what}: {key} not logged"
        assert [run[key][step] for step in steps] == pytest.approx([reference[key][step] for step in steps], abs=1e-5)
        gap = max(gap, *(abs(run[key][step] - reference[key][step]) for step in steps))
    return gap


@pytest.mark.slow
def test_hugging_face_models_at_pp_equal_one_process_and_resume_across_pp(tmp_path):
    reference = _train(tmp_path, "gpt2_pp1", [*GPT2, "pp=1", "tp=1"])
    gaps = {"gpt2 pp=2": _assert_same(_train(tmp_path, "gpt2_pp2", [*GPT2, "pp=2", "tp=1"]), reference, "gpt2 pp=2")}
    both = _train(tmp_path, "gpt2_pp2_tp2", [*GPT2, "pp=2", "tp=2"])
    gaps["gpt2 pp=2 x tp=2"] = _assert_same(both, reference, "gpt2 pp=2 x tp=2")
    saved = tmp_path / "gpt2_pp2_tp2" / "checkpoints" / "step000003.ckpt"
    assert saved.is_dir()
    for pp in (1, 4):
        resumed = _train(tmp_path, f"gpt2_resumed_pp{pp}", [*GPT2, f"pp={pp}", "tp=1", f"ckpt_path='{saved}'"])
        assert min(resumed["train/loss"]) == 3  # it went on from the checkpoint
        gaps[f"gpt2 pp=2 x tp=2 -> pp={pp}"] = _assert_same(resumed, reference, f"resumed at pp={pp}", from_step=3)
    # tp-train-export: the pp=2 checkpoint as one save_pretrained directory with every stage's weights, the one
    # process's (to 1e-4: after 6 Adam steps, a gradient's last-bit difference moves a weight by up to ~1e-5)
    exported = {}
    for pp in (1, 2):
        checkpoint = tmp_path / f"gpt2_pp{pp}" / "checkpoints" / "step000006.ckpt"
        directory = export_hugging_face(checkpoint, tmp_path / f"gpt2_pp{pp}_exported")
        exported[pp] = load_file(Path(directory) / "model.safetensors")
    assert exported[2].keys() == exported[1].keys()
    gaps["gpt2 pp=2 exported"] = max((exported[2][k] - exported[1][k]).abs().max().item() for k in exported[1])
    assert gaps["gpt2 pp=2 exported"] < 1e-4
    llama = _train(tmp_path, "llama_pp1", [*LLAMA, "pp=1", "tp=1"])
    for name, layout in {"pp=2": ["pp=2", "tp=1"], "pp=2 x tp=2": ["pp=2", "tp=2"],
                         "pp=2 x 2 virtual stages": ["pp=2", "tp=1", *VIRTUAL]}.items():  # fmt: skip
        run = _train(tmp_path, f"llama_{len(gaps)}", [*LLAMA, *layout])
        gaps[f"llama {name}"] = _assert_same(run, llama, f"llama {name}")
    print(", ".join(f"{what}: {gap:.1e}" for what, gap in gaps.items()))
