"""`python train.py ep=2` as users type it: bad expert-parallel settings refused in one line before any rank starts
(`EXPERT_CASES`, run by test_preflight in its one start-up), and Hugging Face's Mixtral at ep=2 on two ranks (its
experts split between them) and at ep=2 x tp=2 on four, Qwen3-MoE and gpt-oss at ep=2, logging the gradient norms
and validation losses of the same command at ep=1 on one device with the whole batch (train.py's CSV metrics, to
1e-5)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests import train_cases
from tests.test_pipeline_train import _metrics

ROOT = Path(__file__).resolve().parents[1]
MOE = ["model=moe_tiny", "tp=1"]

# Bad expert-parallel settings and their one line; test_preflight runs them with its own cases, in one start-up.
EXPERT_CASES = {
    "ep_not_dividing_replicas": ([*MOE, "ep=2", "trainer.devices=3"],
                                 "ep=2 does not divide dp x cp = 3 (trainer.devices=3 x trainer.num_nodes=1 over tp=1 "
                                 "x pp=1); expert parallelism splits the experts among those ranks, it adds none: use "
                                 "trainer.devices in [2, 4, 6, 8]"),
    "ep_above_experts": ([*MOE, "ep=16"], "ep=16: expert_parallel_size=16 does not divide the 8 experts of "
                                          "'blocks.0.mlp.experts' (MoEGPT); use one of [1, 2, 4, 8]"),
    "ep_not_dividing_experts": ([*MOE, "ep=3"], "ep=3: expert_parallel_size=3 does not divide the 8 experts"),
    "ep_without_experts": (["tp=1", "ep=2"], "ep=2: expert_parallel_size=2 but GPT has no experts module"),
    "capacity_without_ep": ([*MOE, "trainer.strategy.expert_capacity_factor=1.0"],
                            "ep=1: expert_capacity_factor=1.0 caps the tokens the expert-parallel dispatch sends each "
                            "expert, which expert_parallel_size=1 does not run"),
    "ep_not_positive": ([*MOE, "ep=0"], "ep=0 is out of range; use a positive integer (ranks among dp x cp"),
}  # fmt: skip


# Tiny and short: ten steps (the count), each logging its gradient norm, and a validation at the last. Every
# family at 8 experts (top-2), 64 wide each; Qwen3-MoE and gpt-oss would build 128 experts (75M parameters) by default.
STEPS = 10
SMALL = ["logger=csv", "ckpt_path=null", "data.max_files=20", "data.vocab_size=300", "data.block_size=32",
         f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", "trainer.limit_val_batches=1",
         "trainer.log_every_n_steps=1", "model=hf", "model.config.intermediate_size=64"]  # fmt: skip
FAMILIES = {
    "mixtral": ["+model.config.output_router_logits=true"],  # its routers' balance trains: the auxiliary loss joins
    "qwen3_moe": ["+model.config.num_experts=8", "+model.config.num_experts_per_tok=2",
                  "+model.config.moe_intermediate_size=64"],
    # An exact router tie under the cosine schedule's tiny first lr decides differently at ep=2: a constant lr
    "gpt_oss": ["+model.config.num_local_experts=8", "+model.config.num_experts_per_tok=2", "scheduler=constant"],
}  # fmt: skip


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One data cache (corpus and tokenizer) for every run of this file."""
    return tmp_path_factory.mktemp("cache")


def _train(tmp_path: Path, cache: Path, family: str, overrides: list[str]) -> dict[str, dict[int, float]]:
    out = tmp_path / "_".join([family, *overrides]).replace("=", "")
    overrides = [*SMALL, f"model.type={family}", *FAMILIES[family], f"hydra.run.dir={out}", *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(cache)}
    result = train_cases.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return _metrics(out)


SERIES = ("train/loss", "val/loss", "train/grad_norm")  # train/loss: the whole batch's, at dp=2 too


def _assert_same(
    run: dict[str, dict[int, float]], whole: dict[str, dict[int, float]], what: str, series: tuple = SERIES
) -> None:
    for name in series:
        assert len(run[name]) >= 1 if name == "val/loss" else len(run[name]) == STEPS, (what, name, run)
        assert run[name] == pytest.approx(whole[name], abs=1e-5), (what, name)


@pytest.mark.slow
def test_mixtral_through_train_py_at_ep2_and_ep2_tp2_logs_what_one_device_logs(tmp_path, cache):
    # One device, the whole batch of 16; ranks of 8 each (Lightning's sampler interleaves them: the same 16). At
    # ep=2 x tp=2 (4 ranks) attention is tensor-parallel and each rank holds whole experts: the plan reader drops
    # Hugging Face's expert entries (`keep_experts_whole`); with sequence parallelism each tensor-parallel rank routes
    # its own half of the sequence, and the auxiliary loss sums its rows over both.
    whole = _train(tmp_path, cache, "mixtral", ["tp=1", "ep=1", "data.batch_size=16"])
    _assert_same(_train(tmp_path, cache, "mixtral", ["tp=1", "ep=2", "data.batch_size=8"]), whole, "ep=2")
    sequence_parallel = ["tp=2", "ep=2", "sequence_parallel=true", "data.batch_size=8"]
    _assert_same(_train(tmp_path, cache, "mixtral", sequence_parallel), whole, "ep=2 x tp=2")
    # tp=2 x cp=2 (experts split by the plan): each router sees its context-parallel share, whole over tp
    _assert_same(_train(tmp_path, cache, "mixtral", ["tp=2", "cp=2", "data.batch_size=16"]), whole, "tp=2 x cp=2")


@pytest.mark.slow
def test_qwen3_moe_and_gpt_oss_through_train_py_at_ep2_log_what_one_device_logs(tmp_path, cache):
    for family in ("qwen3_moe", "gpt_oss"):
        whole = _train(tmp_path, cache, family, ["tp=1", "ep=1", "data.batch_size=16"])
        # gpt-oss at its constant lr: float32's rounding of the experts' sums in another order moved the tenth step's
        # gradient norm by 2.0e-5 on an AVX-512 machine (under 1e-5 on others), so its norms are compared in float64
        series = SERIES[:2] if family == "gpt_oss" else SERIES
        _assert_same(_train(tmp_path, cache, family, ["tp=1", "ep=2", "data.batch_size=8"]), whole, family, series)
    # in float64 (the eager loop over experts: torch's grouped_mm takes no float64) every series, norms 0 apart
    whole = _train(tmp_path, cache, "gpt_oss", ["tp=1", "ep=1", "data.batch_size=16", "precision=64"])
    at_ep2 = _train(tmp_path, cache, "gpt_oss", ["tp=1", "ep=2", "data.batch_size=8", "precision=64"])
    _assert_same(at_ep2, whole, "gpt_oss in float64")
