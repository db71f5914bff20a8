"""`python train.py ep=2` as users type it: bad expert-parallel settings refused in one line before any rank starts
(`EXPERT_CASES`, run by test_preflight in its one start-up), and Hugging Face's Mixtral at ep=2 on two ranks (its
experts split between them) logging the gradient norms and validation losses of the same command at ep=1 on one
device with the whole batch (train.py's CSV metrics, to 1e-5)."""

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
    "ep_with_sequence_parallel": ([*MOE, "tp=2", "ep=2", "sequence_parallel=true"],
                                  "ep=2: expert_parallel_size=2 with sequence_parallel=True is not composed yet"),
    "capacity_without_ep": ([*MOE, "trainer.strategy.expert_capacity_factor=1.0"],
                            "ep=1: expert_capacity_factor=1.0 caps the tokens the expert-parallel dispatch sends each "
                            "expert, which expert_parallel_size=1 does not run"),
    "ep_not_positive": ([*MOE, "ep=0"], "ep=0 is out of range; use a positive integer (ranks among dp x cp"),
}  # fmt: skip


def _train(tmp_path: Path, name: str, overrides: list[str]) -> dict[str, dict[int, float]]:
    out = tmp_path / name
    overrides = ["experiment=smoke", "logger=csv", "ckpt_path=null", "trainer.max_steps=4",
                 "trainer.val_check_interval=2", "trainer.limit_val_batches=2", "trainer.log_every_n_steps=1",
                 f"hydra.run.dir={out}", *overrides]  # fmt: skip
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    result = train_cases.run([sys.executable, "train.py", *overrides], cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return _metrics(out)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral"])
def test_train_py_at_ep2_logs_what_one_device_logs(tmp_path, family):
    model = ["tp=1", "model=hf", f"model.type={family}"]
    # One device, the whole batch of 16; two ranks of 8 each (Lightning's sampler interleaves them: the same 16).
    whole = _train(tmp_path, "ep1", [*model, "ep=1", "data.batch_size=16"])
    split = _train(tmp_path, "ep2", [*model, "ep=2", "data.batch_size=8"])
    for name in ("val/loss", "train/grad_norm"):  # train/loss is rank 0's share of the batch only
        assert len(split[name]) >= 2, name
        assert split[name] == pytest.approx(whole[name], abs=1e-5), name
