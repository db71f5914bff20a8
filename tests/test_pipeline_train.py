"""`python train.py pp=2` as users type it: bad pipeline settings refused in one line before any rank starts
(`PIPELINE_CASES`, run by test_preflight), runs at pp=2, at pp=2 x tp=2 with sequence parallelism and at pp=4 cut
before sharding logging the same losses as at pp=1 (train.py's CSV metrics, to 1e-5; the last validation loss is the
final parameters') and counting the whole model's parameters in summary.json, and checkpoints moving between one
process and pp=2 x dp=2 under FSDP2 or pp=2 x cp=2, both ways (and FSDP2's at its own layout), with the losses of the
unbroken run."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path

import pytest

from tests import train_cases

ROOT = Path(__file__).resolve().parents[1]
SIZED = "model._target_=tests.preflight_models.SizedLM"

# Bad pipeline settings and their one line; test_preflight runs them with its own cases, in one start-up.
PIPELINE_CASES = {
    "pp_not_dividing_devices": (["tp=1", "pp=2", "trainer.devices=3"],
                                "= 3 ranks is not a multiple of tp=1 x cp=1 x pp=2; use trainer.devices in [2, 4, 6"),
    "pp_above_blocks": (["tp=1", "pp=3", "trainer.strategy.pipeline_microbatches=4"],
                        "pp=3: pipeline parallelism: 3 stages (pipeline_parallel_size x virtual stages) but GPT's "
                        "'blocks' has 2 blocks; use at most 2 stages"),
    "microbatches_not_dividing_batch": (["tp=1", "pp=2", "trainer.strategy.pipeline_microbatches=3"],
                                        "data.batch_size=8 is not a multiple of trainer.strategy.pipeline_microbatches"
                                        "=3 (each batch runs as that many microbatches); use data.batch_size=9"),
    "dualpipev_with_fewer_microbatches_than_stages": (
        ["tp=1", "pp=2", "model.config.n_layer=4", "trainer.strategy.pipeline_schedule=dualpipev",
         "trainer.strategy.pipeline_virtual_stages=2"],
        "pipeline_schedule='dualpipev' needs at least as many microbatches as stages (2 x 2 virtual = 4), got "
        "pipeline_microbatches=2; use pipeline_microbatches=4"),
    "virtual_schedule_without_virtual_stages": (["tp=1", "pp=2", "trainer.strategy.pipeline_schedule=looped_bfs"],
                                                "runs several stages per rank: set pipeline_virtual_stages to 2 or "
                                                "more (got 1)"),
    "virtual_stages_above_blocks": (["tp=1", "pp=2", "trainer.strategy.pipeline_schedule=interleaved_1f1b",
                                     "trainer.strategy.pipeline_virtual_stages=2"],
                                    "4 stages (pipeline_parallel_size x virtual stages) but GPT's 'blocks' has 2 "
                                    "blocks"),
    "virtual_stages_not_dividing_blocks": (["tp=1", "pp=2", "trainer.strategy.pipeline_schedule=interleaved_1f1b",
                                            "trainer.strategy.pipeline_virtual_stages=2", "model.config.n_layer=6"],
                                           "pp=2: pipeline parallelism: GPT's 'blocks' has 6 blocks, which pp=2 x "
                                           "virtual stages=2 = 4 stages do not split evenly; use virtual stages in "
                                           "[3]"),
    "model_without_blocks": ([SIZED, "+model.planned=false", "tp=1", "pp=2"], "SizedLM"),
}  # fmt: skip


def _metrics(run_dir: Path) -> dict[str, dict[int, float]]:
    """series -> step -> value, from the CSV logger's metrics.csv."""
    series: dict[str, dict[int, float]] = {}
    with open(next(run_dir.glob("csv/version_*/metrics.csv"))) as file:
        for row in csv.DictReader(file):
            for name in ("train/loss", "val/loss", "train/grad_norm"):
                if row.get(name):
                    series.setdefault(name, {})[int(row["step"])] = float(row[name])
    return series


def _train(tmp_path: Path, name: str, overrides: list[str], ranks: int = 4) -> dict[str, dict[int, float]]:
    """The metrics of `python train.py experiment=smoke <overrides>` run in `tmp_path/name`, its CSV logged; up to
    `ranks` ranks are forked (more start as fresh interpreters)."""
    out = tmp_path / name
    overrides = ["experiment=smoke", "logger=csv", "ckpt_path=null", "trainer.log_every_n_steps=1", *overrides,
                 f"hydra.run.dir={out}"]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "train.py", *overrides]
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=600, child_ranks=ranks - 1)
    assert result.returncode == 0, result.stderr[-4000:]
    return _metrics(out)


@pytest.mark.slow
def test_train_py_at_pp2_and_pp4_logs_the_losses_of_pp1(tmp_path):
    # Our GPT with 4 blocks, its embedding tied to its head: at pp=4 the tie spans the first and the last rank, and
    # without verification each rank gives storage to its own stage only (cut before shard). 10 AdamW steps each.
    runs, summaries = {}, {}
    shapes = {
        "pp1": ["tp=1", "pp=1"],
        "pp2": ["tp=1", "pp=2"],
        "pp2_tp2_sp": ["tp=2", "pp=2", "sequence_parallel=true"],
        "pp4_cut_before_shard": ["tp=1", "pp=4", "trainer.strategy.verify_plan=false"],
    }
    for shape, sizes in shapes.items():
        steps = ["model.config.n_layer=4", "trainer.max_steps=10", "trainer.val_check_interval=5",
                 "trainer.limit_val_batches=2"]  # fmt: skip
        runs[shape] = _train(tmp_path, shape, [*sizes, *steps])
        summaries[shape] = json.loads((tmp_path / shape / "summary.json").read_text())
    assert sorted(runs["pp1"]["train/loss"]) == list(range(10)), runs["pp1"]["train/loss"]
    for shape in ("pp2", "pp2_tp2_sp", "pp4_cut_before_shard"):
        for name in ("train/loss", "val/loss", "train/grad_norm"):
            assert runs[shape][name], name
            assert runs[shape][name] == pytest.approx(runs["pp1"][name], abs=1e-5), (shape, name)
        # every stage's parameters, the tied embedding and head once; rank 0 holds its stage's (its shards at tp=2)
        whole, own = summaries[shape]["parameters"], summaries[shape]["parameters_on_rank"]
        assert whole == summaries["pp1"]["parameters"] == summaries["pp1"]["parameters_on_rank"], (shape, whole)
        assert summaries[shape]["trainable_parameters"] == whole and own < whole * 0.75, (shape, own, whole)


@pytest.mark.slow
def test_checkpoints_move_between_one_process_and_pp2_with_fsdp_or_cp_with_the_unbroken_losses(tmp_path):
    # One process saves at steps 2 and 4; pp=2 x dp=2 under FSDP2 and pp=2 x cp=2 each resume its step 2 and save
    # their own step 4, which resumes at the same layout (FSDP2) and in one process. Every resumed step logs the
    # loss and gradient norm of the one process's unbroken run. Each FSDP2 stage's shards are DTensors over its own
    # data-parallel ranks: a save that placed them over the pipeline ranks too had DCP refuse the plan.
    steps = ["trainer.max_steps=6", "trainer.val_check_interval=2", "trainer.limit_val_batches=0", "tp=1"]
    one = ["pp=1", "trainer.devices=1", "data.batch_size=8"]
    layouts = {"fsdp": ["pp=2", "dp=2", "data_parallel=fsdp", "data.batch_size=4"],
               "cp": ["pp=2", "cp=2", "data.batch_size=8"]}  # fmt: skip
    unbroken = _train(tmp_path, "one", [*steps, *one, "ckpt_path=null", "+callbacks.checkpoint.save_top_k=-1"])

    def resumed(name: str, sizes: list[str], saved_by: str, step: int) -> None:
        checkpoint = tmp_path / saved_by / "checkpoints" / f"step{step:06d}.ckpt"
        run = _train(tmp_path, name, [*steps, *sizes, f"ckpt_path={checkpoint}", "+callbacks.checkpoint.save_top_k=-1"])
        for series in ("train/loss", "train/grad_norm"):  # the loaded weights, then the loaded AdamW state
            assert sorted(run[series]) == list(range(step, 6)), (name, series, run[series])
            expected = {logged: unbroken[series][logged] for logged in range(step, 6)}
            assert run[series] == pytest.approx(expected, abs=1e-5), (name, series)

    for name, sizes in layouts.items():
        resumed(name, sizes, "one", 2)
        resumed(f"{name}_at_pp1", one, name, 4)
    resumed("fsdp_again", layouts["fsdp"], "fsdp", 4)
