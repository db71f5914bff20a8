"""Choosing the degrees (`tp_train.tools.choose`, `python train.py parallel=auto`): every layout of the world simulated
on fake ranks, those over the memory dropped with their need, the rest ranked by predicted time; the global batch held;
the choice written into the run's config and passed to its ranks; bad input one line each. Whether the choice is
fast in fact is the benchmark's (`python -m tp_train.tools.bench.step_time`), not a timed test."""

from __future__ import annotations

import json
import os
import sys

import pytest

from models import GPT, GPTConfig
from tests import train_cases
from tests.test_configs import _compose
from tp_train.app.auto_layout import CHOSEN_ENVIRONMENT_VARIABLE, apply_auto_layout
from tp_train.errors import ConfigError
from tp_train.parallel.dims import ParallelDims
from tp_train.tools.choose import HEADROOM, choose_layout
from tp_train.tools.hardware import CPU_HERE
from tp_train.tools.simulate import simulate_step
from tp_train.tools.steps import language_model_step
from tp_train.training.apply_order import TrainingOptions

ROOT = train_cases.ROOT
SEQ, VOCAB, GLOBAL_BATCH = 32, 256, 8


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64, dropout=0.0))


def _choose(memory: float, **pinned):
    return choose_layout(_gpt, 2, GLOBAL_BATCH, SEQ, VOCAB, memory, CPU_HERE, pinned)


@pytest.fixture(scope="module")
def roomy() -> list:
    """The layouts of 2 ranks with memory to spare (1 GiB a rank; the tiny model needs a few MiB)."""
    return _choose(2**30)


def test_the_layouts_that_fit_come_first_fastest_first_each_holding_the_global_batch(roomy):
    candidates = roomy
    labels = [c.layout.label() for c in candidates]
    assert {"tp=1 pp=1 dp=2 ddp", "tp=1 pp=1 dp=2 fsdp", "tp=2 pp=1 dp=1", "tp=1 pp=2 dp=1 1f1b x4"} <= set(labels)
    fitting = [c for c in candidates if c.fits]
    assert [c.time.total for c in fitting] == sorted(c.time.total for c in fitting)
    for candidate in fitting:
        layout = candidate.layout
        assert layout.dims.dp * layout.micro_batch * layout.accumulation == GLOBAL_BATCH
        assert candidate.tokens_per_s == pytest.approx(GLOBAL_BATCH * SEQ / candidate.time.total)
    # two stages a rank on a pipeline of 2 ranks: 4 stages of a 2-block model, which the pipeline refuses
    [unshardable] = [c for c in candidates if c.unshardable]
    assert (
        unshardable.layout.label().startswith("tp=1 pp=2 dp=1 interleaved_1f1b")
        and "2 blocks" in unshardable.unshardable
    )


def test_a_tighter_budget_drops_layouts_with_their_need_or_fits_them_by_checkpointing_or_accumulating(roomy):
    roomy = {c.layout.label(): c for c in roomy if c.fits}
    needs = sorted(c.memory for c in roomy.values())
    budget = (needs[0] + needs[-1]) / 2 / (1 - HEADROOM)  # between the smallest layout's need and the largest's
    tight = _choose(budget)
    for candidate in tight:  # accumulating or not, each data-parallel rank's share of the global batch is whole
        layout = candidate.layout
        assert layout.dims.dp * layout.micro_batch * layout.accumulation == GLOBAL_BATCH, layout
    assert all(c.memory <= budget * (1 - HEADROOM) for c in tight if c.fits)
    assert all(c.memory > budget * (1 - HEADROOM) for c in tight if not c.fits and not c.unshardable)
    refitted = [c for c in tight if c.fits and c.layout.label() not in roomy]  # as given, they needed more
    assert refitted and all(c.layout.options.activation_checkpointing or c.layout.accumulation > 1 for c in refitted)


def test_accumulating_micro_batches_fits_what_checkpointing_alone_does_not():
    def need(micro_batch: int) -> int:  # tp=2 with activation checkpointing, as the chooser simulates it
        dims = ParallelDims.from_world(2, tp=2)
        options = TrainingOptions(loss_parallel=True, activation_checkpointing=True)
        return simulate_step(_gpt, dims, language_model_step(micro_batch, SEQ, VOCAB), options).memory.peak

    whole, quarter = need(4), need(1)
    [best, *_] = choose_layout(_gpt, 2, 4, SEQ, VOCAB, (whole + quarter) / 2 / (1 - HEADROOM), CPU_HERE, {"tp": 2})
    assert best.fits and best.layout.accumulation > 1 and best.layout.micro_batch * best.layout.accumulation == 4


def test_pinned_degrees_are_kept():
    assert {c.layout.dims.tp for c in _choose(2**30, tp=2)} == {2}
    assert {c.layout.options.data_parallel for c in _choose(2**30, dp=2, data_parallel="fsdp")} == {"fsdp"}
    with pytest.raises(
        ValueError, match=r"^choose_layout: cannot pin cp; pin one of tp, pp, dp, dp_shard, data_parallel$"
    ):
        _choose(2**30, cp=2)


def test_each_node_holds_the_same_data_parallel_ranks_and_a_batch_the_pipeline_cannot_split_is_said():
    # 2 ranks on 2 nodes: only dp=2 puts a data-parallel rank on each node (the config's dp is per node)
    across = choose_layout(_gpt, 2, GLOBAL_BATCH, SEQ, VOCAB, 2**30, CPU_HERE, num_nodes=2)
    assert {c.layout.dims.dp for c in across} == {2}
    # one sequence a step: pp=2 has no micro-batch to split into its 2 stages' microbatches
    odd = {c.layout.label(): c for c in choose_layout(_gpt, 2, 1, SEQ, VOCAB, 2**30, CPU_HERE)}
    assert odd["tp=2 pp=1 dp=1"].fits
    assert (
        odd["tp=1 pp=2 dp=1 1f1b x2"].unshardable
        == "no micro-batch of 1 sequences a rank divides into 2 pipeline stages"
    )


def test_hsdp_shard_groups_within_a_node_are_layouts_of_their_own_and_a_pinned_one_is_written(tmp_path):
    # 4 ranks on 2 nodes: FSDP2 over all 4 data-parallel ranks, or HSDP's groups of 2 (one per node), or DDP
    candidates = choose_layout(_gpt, 4, GLOBAL_BATCH, SEQ, VOCAB, 2**30, CPU_HERE, {"tp": 1, "pp": 1}, num_nodes=2)
    memory = {c.layout.label(): c.memory for c in candidates}
    assert set(memory) == {"tp=1 pp=1 dp=4 ddp", "tp=1 pp=1 dp=4 fsdp", "tp=1 pp=1 dp=4 hsdp x2"}
    assert memory["tp=1 pp=1 dp=4 fsdp"] < memory["tp=1 pp=1 dp=4 hsdp x2"] < memory["tp=1 pp=1 dp=4 ddp"]
    overrides = ["trainer.devices=2", "trainer.num_nodes=2", "global_batch_size=8", "tp=1", "pp=1", "dp_shard=2"]
    cfg, report = _auto(tmp_path, overrides)
    assert report.splitlines()[0].endswith("chose tp=1 pp=1 dp=4 hsdp x2"), report
    assert cfg.dp_shard == 2 and cfg.trainer.strategy.data_parallel_shard_size == 2 and cfg.data_parallel == "fsdp"


def _auto(tmp_path, overrides: list[str], rank: int = 1):
    """The config `apply_auto_layout` leaves, and its report; rank 1 (a started rank) leaves no choice behind."""
    cfg = _compose(tmp_path, ["experiment=smoke", "parallel=auto", *overrides])
    return cfg, apply_auto_layout(cfg, overrides, rank=rank)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["global_batch_size=8"], r"^parallel=auto needs the world to fill: give trainer\.devices=N"),
        (["trainer.devices=2"], r"^parallel=auto holds the global batch fixed: give global_batch_size=N"),
        (["trainer.devices=2", "global_batch_size=8", "hardware=tpu"], r"^hardware='tpu' is not a known profile"),
        (["trainer.devices=2", "global_batch_size=8", "cp=2"], r"^cp=2 with parallel=auto: the chooser does not"),
        (
            ["trainer.devices=2", "global_batch_size=true"],
            r"^parallel=auto holds the global batch fixed \(global_batch_size=True\)",
        ),
        (["trainer.devices=2", "global_batch_size=8", "precision=foo"], r"^precision=foo is not a precision"),
        (
            ["trainer.devices=2", "global_batch_size=8", "dp_shard=2", "data_parallel=ddp"],
            r"^parallel=auto: choose_layout: dp_shard=2 shards over groups of FSDP2 ranks \(HSDP\), which "
            r"data_parallel=ddp does not",
        ),
        (
            ["trainer.devices=2", "global_batch_size=8", "tp=3"],
            r"^parallel=auto: choose_layout: no layout of 2 ranks has tp=3 and takes a global batch of 8; pin degrees",
        ),
        (
            ["trainer.devices=2", "global_batch_size=2", "tp=2", "memory_per_device=0.001"],
            r"^parallel=auto: no layout of 2 ranks fits 0\.9 MiB a device \(1\.0 MiB less 10% headroom\); the "
            r"smallest, tp=2 pp=1 dp=1 ac accumulate 2, needs [0-9.]+ MiB; give more devices",
        ),
    ],
)
def test_bad_input_to_parallel_auto_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        _auto(tmp_path, overrides)


def test_a_true_precision_hugging_face_model_is_simulated_in_its_dtype(tmp_path):
    """Built in bf16 as Lightning's bf16-true builds it (a fake model converted afterwards could not swap a Hugging
    Face model's tied embedding): its parameters and AdamW states take half the bytes of fp32's."""
    memory = {}
    for precision in ("32", "bf16-true"):
        overrides = ["model=hf", f"precision={precision}", "trainer.devices=2", "global_batch_size=2", "tp=2"]
        cfg, _ = _auto(tmp_path, overrides)
        memory[precision] = cfg.chosen_layout.memory_mib
    assert 0.4 < memory["bf16-true"] / memory["32"] < 0.6, memory


def test_the_choice_is_written_where_the_strategy_data_and_trainer_read_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CHOSEN_ENVIRONMENT_VARIABLE, "")  # so that the choice left below is removed after the test
    monkeypatch.delenv(CHOSEN_ENVIRONMENT_VARIABLE)
    overrides = ["trainer.devices=2", "global_batch_size=8", "tp=2"]
    cfg, report = _auto(tmp_path, overrides, rank=0)
    assert report.splitlines()[0].endswith("chose tp=2 pp=1 dp=1") and cfg.tp == 2 and cfg.dp == 1
    assert cfg.data.batch_size * cfg.trainer.accumulate_grad_batches == 8
    assert cfg.trainer.strategy.tensor_parallel_size == 2 and cfg.chosen_layout.label == "tp=2 pp=1 dp=1"
    # the ranks the launching process starts read its choice from their environment rather than choosing again
    passed = json.loads(os.environ[CHOSEN_ENVIRONMENT_VARIABLE])
    assert passed["tp"] == 2
    other = {"tp": 1, "pp": 2, "dp": 1, "data_parallel": "fsdp", "activation_checkpointing": True, "batch_size": 2,
             "accumulate_grad_batches": 4, "pipeline_schedule": "interleaved_1f1b", "pipeline_microbatches": 2,
             "pipeline_virtual_stages": 2}  # fmt: skip
    monkeypatch.setenv(CHOSEN_ENVIRONMENT_VARIABLE, json.dumps({**passed, **other}))
    started, report = _auto(tmp_path, overrides)
    strategy = started.trainer.strategy
    assert report is None
    assert (started.tp, started.pp, started.dp, started.data_parallel, started.activation_checkpointing) == (
        1,
        2,
        1,
        "fsdp",
        True,
    )
    assert (started.data.batch_size, started.trainer.accumulate_grad_batches) == (2, 4)
    assert started.data.whole_steps is True  # every step the same sequences, on this layout and any it resumes on
    assert (strategy.pipeline_parallel_size, strategy.data_parallel, strategy.activation_checkpointing) == (
        2,
        "fsdp",
        True,
    )
    assert (strategy.pipeline_schedule, strategy.pipeline_microbatches, strategy.pipeline_virtual_stages) == (
        "interleaved_1f1b",
        2,
        2,
    )


@pytest.mark.slow
def test_train_py_parallel_auto_trains_the_chosen_layout_and_records_it(tmp_path):
    result = train_cases.run(
        [sys.executable, "train.py", "experiment=smoke", "parallel=auto", "trainer.devices=2", "global_batch_size=8",
         "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1", "logger=none",
         f"hydra.run.dir={tmp_path}"],
        cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    chosen = result.stdout.splitlines()[0]
    assert chosen.startswith("parallel=auto: 2 ranks, ") and "; chose tp=" in chosen, result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and chosen.endswith(f"chose {summary['chosen_layout']['label']}")
