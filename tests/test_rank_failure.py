"""A rank that dies (SIGKILL, an exception) ends the whole `train.py` job within seconds, non-zero, with a message
naming the rank; a rank that hangs fails its peers' collectives after the configured timeout, on every group of
the dp x tp mesh. Faults are injected by `tests.faults.FailAtStep`, a callback given on the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import pytest
import torch

from tests.distributed import run_on_ranks
from tests.lightning_helpers import LitLM, loader
from tp_train import TensorParallelStrategy

ROOT = Path(__file__).resolve().parents[1]
FAULT_STEP = 2

# case -> (rank that fails, how, what stderr must say)
CASES = {
    "rank1_sigkill": (1, "sigkill", r"error: rank 1 \(pid \d+\) was killed by SIGKILL; stopping the job"),
    "rank0_sigkill": (0, "sigkill", r"error: rank 1 \(pid \d+\): rank 0, the launching process \(pid \d+\), died"),
    "rank1_raises": (1, "raise", r"error: rank 1 \(pid \d+\) failed: RuntimeError: injected failure on rank 1"),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the data is prepared once, by the first case


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_dead_rank_ends_the_job_fast_and_is_named(case, cache, tmp_path):
    rank, how, expected = CASES[case]
    record = tmp_path / "fault.json"
    fault = {"_target_": "tests.faults.FailAtStep", "rank": rank, "step": FAULT_STEP, "how": how, "record": record}
    command = [
        sys.executable, "train.py", "experiment=smoke", "tp=2", "logger=none", "data.max_files=20",
        "trainer.max_steps=50", "trainer.limit_val_batches=0", "~callbacks.progress_bar",
        "trainer.enable_progress_bar=false",
        f"hydra.run.dir={tmp_path}", *(f"+callbacks.fault.{key}={value}" for key, value in fault.items()),
    ]  # fmt: skip
    env = {**os.environ, "TP_TRAIN_CACHE": str(cache)}
    # The pipes close once every rank has exited (the children inherit them): this times the whole job.
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()
    assert record.exists(), result.stderr[-3000:]  # the fault fired, mid-training
    after_fault = ended - json.loads(record.read_text())["time"]
    assert result.returncode != 0
    assert after_fault < 60, f"the job took {after_fault:.0f}s to end after rank {rank} failed"
    assert re.search(expected, result.stderr), result.stderr[-3000:]
    print(f"{case}: ended {after_fault:.1f}s after the fault, status {result.returncode}")


class _HangAtStep(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == 3 and trainer.global_step == 1:
            time.sleep(300)


def _fit_with_a_hung_rank(rank, world_size, timeout_s):
    torch.manual_seed(0)
    strategy = TensorParallelStrategy(tensor_parallel_size=2, timeout=timedelta(seconds=timeout_s))
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, callbacks=[_HangAtStep()], max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(LitLM(), loader(2, 3))


@pytest.mark.slow
def test_collective_timeout_applies_to_every_mesh_group():
    """dp=2 x tp=2, rank 3 hangs: its data-parallel peer (rank 1) waits in DDP's all-reduce over a mesh sub-group,
    which torch would give a 30-minute timeout; the strategy's 5 s applies there too."""
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 5000ms"):
        run_on_ranks(_fit_with_a_hung_rank, 4, 5.0, timeout=120)
    assert time.monotonic() - start < 100
