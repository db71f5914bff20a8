"""Bad configs are refused by train.py before any rank starts: one line naming the key, the value and what would
work; exit status 2; no traceback. No case starts a rank, so all of them run at once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import train_cases
from tests.test_expert_parallel_train import EXPERT_CASES
from tests.test_pipeline_train import PIPELINE_CASES

ROOT = Path(__file__).resolve().parents[1]
SIZED = "model._target_=tests.preflight_models.SizedLM"  # widths set one by one (GPT derives them from each other)

CASES = {
    "ranks_not_multiple_of_tp": (["tp=3", "trainer.devices=2"], "trainer.devices=2 x trainer.num_nodes=1 = 2 ranks"),
    "nodes_not_multiple_of_tp": (["tp=2", "trainer.devices=1", "trainer.num_nodes=3"],
                                 "trainer.devices=1 x trainer.num_nodes=3 = 3 ranks is not a multiple of tp=2"),
    "tp_not_positive": (["tp=0"], "tp=0 must be a positive integer"),
    "unknown_precision": (["precision=fp8"], "precision=fp8 is not a precision; use one of 32, 16, bf16"),
    "heads_not_divisible": (["model.config.n_head=2", "tp=4"], "config.n_head=2 is not divisible by tensor_parallel"),
    "kv_heads_not_divisible": ([SIZED, "+model.kv_heads=3", "+model.heads=6", "+model.width=96", "tp=2"],
                               "config.num_key_value_heads=3 neither divides nor is divisible by tensor_parallel_size"
                               "=2: each rank must hold whole kv heads, or replicas of one; use a tensor_parallel"),
    "hidden_not_divisible": ([SIZED, "+model.width=66", "+model.heads=null", "tp=4"],
                             "module 'attn.q' (Linear): out_features=66 is not divisible by tensor_parallel_size=4; "
                             "use a tensor_parallel_size in [1, 2, 3, 6, 11, 22, 33]"),
    "ffn_not_divisible": ([SIZED, "+model.ffn=50", "tp=4"],
                          "module 'fc' (Linear): out_features=50 is not divisible by tensor_parallel_size=4"),
    "model_without_plan": ([SIZED, "+model.planned=false", "tp=2"],
                           "no tensor-parallel plan for SizedLM, and the auto-planner could not"),
    "model_rejects_config": (["model.config.n_head=3", "tp=1"], "model: n_embd=64 must be a multiple of n_head=3"),
    "missing_data_path": (["data.source=./no/such/*.txt"], "data.source=./no/such/*.txt: no such file"),
    "sequence_longer_than_context": (["model.config.block_size=32"], "data.block_size=64 exceeds the model's context"),
    "sequence_not_divisible_by_tp": (
        ["tp=2", "sequence_parallel=true", "data.block_size=63"],
        "data.block_size=63 is not a multiple of 2; use data.block_size=62",
    ),
    "missing_checkpoint": (["ckpt_path=/no/such/last.ckpt"],
                           "ckpt_path: checkpoint /no/such/last.ckpt: no such file or directory; use a checkpoint"),
    "unknown_nonfinite_action": (["nonfinite=ignore"], "nonfinite=ignore: use nonfinite=stop (end the run at a NaN"),
    "collective_timeout_not_positive": (["collective_timeout_s=0"], "collective_timeout_s=0: use a positive number"),
    "unknown_data_parallel": (["data_parallel=zero"], "data_parallel=zero: use data_parallel=ddp (each data-parallel"),
    "checkpoint_is_a_file": (["ckpt_path=train.py"], "checkpoint train.py: a file, not a checkpoint directory"),
    "samples_with_sequence_parallel": (["tp=2", "sequence_parallel=true", 'samples.prompts=["def "]'],
                                       "samples.prompts=['def '] with sequence_parallel=true: samples are drawn one"),
    # Numbers Lightning or the data module would reject inside the ranks (tp_train.app.config_values).
    "batch_size_zero": (["data.batch_size=0"], "data.batch_size=0 is out of range; use a positive integer"),
    "block_size_one": (["data.block_size=1"], "data.block_size=1 is out of range; use an integer >= 2"),
    "num_workers_negative": (["data.num_workers=-1"], "data.num_workers=-1 is out of range; use an integer >= 0"),
    "val_fraction_one": (["data.val_fraction=1.0"], "data.val_fraction=1.0 is out of range; use a fraction in (0, 1)"),
    "vocab_size_too_small": (["data.vocab_size=100"], "data.vocab_size=100 is out of range"),
    "max_files_zero": (["data.max_files=0"], "data.max_files=0 is out of range; use a positive integer, or null"),
    "max_steps_negative": (["trainer.max_steps=-5"], "trainer.max_steps=-5 is out of range; use a positive"),
    "max_epochs_negative": (["trainer.max_epochs=-2"], "trainer.max_epochs=-2 is out of range"),
    "min_steps_negative": (["trainer.min_steps=-1"], "trainer.min_steps=-1 is out of range"),
    "val_check_interval_zero": (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 is out of range"),
    "val_check_interval_fraction": (["trainer.val_check_interval=0.5"],
                                    "trainer.val_check_interval=0.5 is a fraction of an epoch, which needs"),
    "val_check_interval_above_one": (["trainer.val_check_interval=1.5", "trainer.check_val_every_n_epoch=1"],
                                     "trainer.val_check_interval=1.5 is out of range; use a fraction in (0.0, 1.0]"),
    "check_val_every_zero": (["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch=0 is out of"),
    "accumulate_zero": (["trainer.accumulate_grad_batches=0"], "trainer.accumulate_grad_batches=0 is out of range"),
    "limit_train_negative": (["trainer.limit_train_batches=-1"], "trainer.limit_train_batches=-1 is out of range"),
    "limit_val_above_one": (["trainer.limit_val_batches=1.5"], "trainer.limit_val_batches=1.5 is out of range; use an"),
    "log_every_negative": (["trainer.log_every_n_steps=-1"], "trainer.log_every_n_steps=-1 is out of range"),
    "num_sanity_negative": (["trainer.num_sanity_val_steps=-2"], "trainer.num_sanity_val_steps=-2 is out of range"),
    "clip_negative": (["trainer.gradient_clip_val=-1.0"], "trainer.gradient_clip_val=-1.0 is out of range"),
    "clip_algorithm": (["trainer.gradient_clip_algorithm=max"], "trainer.gradient_clip_algorithm=max is out of"),
    "devices_zero": (["trainer.devices=0"], "trainer.devices=0 is out of range"),
    "dp_zero": (["dp=0"], "dp=0 is out of range; use a positive integer"),
    "block_not_divisible_by_2cp": (["cp=4", "data.block_size=36"],
                                   "data.block_size=36 is not a multiple of 2 x cp = 8 (each context-parallel rank"),
    "ranks_not_multiple_of_tp_cp": (["tp=2", "cp=2", "trainer.devices=6"],
                                    "= 6 ranks is not a multiple of tp=2 x cp=2 x pp=1; use trainer.devices in [4"),
    "cp_attention_dropout": (["cp=2", "model.config.dropout=0.1"],
                             "cp=2: blocks.0.attn: attention dropout 0.1 cannot be context-parallel; set it to 0"),
    "cp_samples": (["cp=2", "samples.prompts=[x]"], "samples.prompts=['x'] with cp=2: samples are drawn one token"),
    "alltoall_heads_not_dividing_cp": (["tp=1", "cp=2", "trainer.strategy.context_parallel_rotation=alltoall",
                                        "model.config.n_head=1"],
                                       "cp=2: config.n_head=1 at tp=1: 1 query heads per rank (after tensor "
                                       "parallelism) do not divide by cp=2"),
    "dp_shard_not_dividing_dp": (["dp=4", "dp_shard=3", "data_parallel=fsdp"],
                                 "dp_shard=3 does not divide the 4 data-parallel ranks (dp per node x nodes); use "
                                 "dp_shard in [2, 4]"),
    "dp_shard_with_ddp": (["dp=4", "dp_shard=2"], "dp_shard=2 with data_parallel=ddp: HSDP needs data_parallel=fsdp"),
    "invariant_with_fsdp": (["tp=2", "dp=2", "data_parallel=fsdp", "numerics=invariant"],
                            "numerics='invariant' covers tensor parallelism and DDP's data parallelism so far, not "
                            "dp=2 with data_parallel=fsdp"),
    "invariant_in_bf16_true": (["numerics=invariant", "precision=bf16-true"],
                               "numerics=invariant runs precision=32, 64 or bf16 so far, not precision=bf16-true"),
    "invariant_batch_not_leaves": (["numerics=invariant", "data.batch_size=6"],
                                   "numerics=invariant cuts the global batch (data.batch_size=6 x dp=1) into 8 leaves"),
    "unknown_numerics": (["numerics=exact"], "numerics: numerics='exact'; use one of fast, invariant"),
}  # fmt: skip
CASES |= PIPELINE_CASES  # python train.py pp=2's refusals, in the same start-up
CASES |= EXPERT_CASES  # and ep=2's


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, tuple[dict, Path]]:
    """Every case's train.py run (one start-up for all: see tests.train_cases)."""
    directories = {case: tmp_path_factory.mktemp(case) for case in CASES}
    cases = [
        {
            "overrides": ["experiment=smoke", "logger=none", f"hydra.run.dir={directories[case]}", *overrides],
            "env": {"TP_TRAIN_CACHE": str(directories[case] / "cache")},
            "directory": str(directories[case]),
        }
        for case, (overrides, _) in CASES.items()
    ]
    results = train_cases.run_batch(cases, timeout=600)
    return {case: (result, directories[case]) for case, result in zip(CASES, results, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bad_config_is_one_line_exit_2_no_traceback(outcomes, case):
    _, expected = CASES[case]
    result, directory = outcomes[case]
    assert result["status"] == 2, result["stderr"][-2000:]
    assert "Traceback" not in result["stderr"]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], result["stderr"][-2000:]
    assert not (directory / "cache").exists()  # refused before any data was prepared


def test_the_launching_process_checks_once_and_its_child_ranks_skip_the_check(tmp_path, monkeypatch):
    """Rank 0 checks and marks the environment Lightning's launcher copies to its child ranks; a child rank with the
    mark builds nothing; a process without it (a rank torchrun started) checks, and a bad config is refused there."""
    from hydra.utils import instantiate

    from tests.test_configs import _compose
    from tp_train.app import preflight

    monkeypatch.setenv(preflight.PASSED_ENVIRONMENT_VARIABLE, "")  # unmarked; the mark is undone after the test
    cfg = _compose(tmp_path, ["model.config.n_layer=1", "tp=1"])
    builds = []

    def build():
        builds.append(1)
        return instantiate(cfg.model)

    preflight.check_in_launching_process(cfg, build, rank=1)  # a cluster's rank: checks, marks nothing
    assert builds and os.environ[preflight.PASSED_ENVIRONMENT_VARIABLE] == ""
    preflight.check_in_launching_process(cfg, build, rank=0)
    assert os.environ[preflight.PASSED_ENVIRONMENT_VARIABLE] == "1"
    builds.clear()
    preflight.check_in_launching_process(cfg, build, rank=1)  # the child rank
    assert not builds
    monkeypatch.setenv(preflight.PASSED_ENVIRONMENT_VARIABLE, "")
    bad = _compose(tmp_path, ["model.config.n_layer=1", "tp=0"])
    with pytest.raises(preflight.ConfigError, match="tp=0 must be a positive integer"):
        preflight.check_in_launching_process(bad, build, rank=1)
