"""Context parallelism through `python train.py` with checkpoints, FSDP2 and gradient accumulation (subprocesses,
real ranks; slow): a checkpoint saved at tp=2 x cp=2 resumes at cp=1 with the losses an unbroken cp=1 run has, and
FSDP2 over the flattened dp x cp ranks trains with the cp=1 losses, every run accumulating 2 micro-batches."""

from __future__ import annotations

import pytest

from tests.test_context_parallel_train import _losses

COMMON = ("trainer.accumulate_grad_batches=2", "ckpt_path=null")


@pytest.mark.slow
def test_tp2_cp2_checkpoint_resumes_at_cp1_and_fsdp_over_dp_x_cp_trains_alike(tmp_path):
    unbroken = _losses(tmp_path, "cp1", *COMMON)
    sharded = _losses(tmp_path, "cp2fsdp", *COMMON, "cp=2", "data_parallel=fsdp")
    assert max(abs(a - b) for a, b in zip(unbroken, sharded, strict=True)) < 1e-5, (unbroken, sharded)
    _losses(tmp_path, "tp2cp2", *COMMON, "tp=2", "cp=2", steps=3)
    checkpoint = next((tmp_path / "tp2cp2").glob("checkpoints/last*.ckpt"))
    resumed = _losses(tmp_path, "resumed", "trainer.accumulate_grad_batches=2", f"ckpt_path={checkpoint}")
    assert len(resumed) == 2, resumed  # steps 4 and 5
    worst = max(abs(a - b) for a, b in zip(resumed, unbroken[3:], strict=True))
    assert worst < 1e-5, f"resumed at cp=1 {resumed} vs unbroken {unbroken[3:]}"
