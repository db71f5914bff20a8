"""Context parallelism through `python train.py` (subprocesses, real ranks): Llama and Qwen2 (GQA, RoPE) at cp=2 and
tp=2 x cp=2 train with the cp=1 losses, and with data.document_mask Qwen2 at cp=1, at cp=2 (ring) and at tp=2 x
cp=2 with the alltoall rotation train alike. Slow: each run
starts real ranks (tests/test_context_parallel_resume.py holds the checkpoint and FSDP2 cases, so that pytest-xdist
runs the two files side by side)."""

from __future__ import annotations

import pytest

from tests.test_train_app import _csv_losses, run_train

SMALL = (
    "logger=csv", "data.max_files=20", "data.vocab_size=300", "data.block_size=32", "trainer.log_every_n_steps=1",
    "trainer.limit_val_batches=1", "scheduler=constant",
)  # fmt: skip


def _losses(tmp_path, name, *overrides, steps=5):
    run_dir = tmp_path / name
    run_train(
        *SMALL, f"trainer.max_steps={steps}", f"trainer.val_check_interval={steps}", f"hydra.run.dir={run_dir}",
        *overrides, cache=tmp_path / "cache",
    )  # fmt: skip
    return _csv_losses(run_dir)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_hugging_face_at_cp2_and_tp2_cp2_trains_with_the_cp1_losses(tmp_path, family):
    runs = {
        (tp, cp): _losses(
            tmp_path, f"tp{tp}cp{cp}", "model=hf", f"model.type={family}", f"tp={tp}", f"cp={cp}", "ckpt_path=null"
        )  # fmt: skip
        for tp, cp in ((1, 1), (1, 2), (2, 2))
    }
    for key, losses in runs.items():
        assert len(losses) == 5, (key, losses)
        worst = max(abs(a - b) for a, b in zip(losses, runs[1, 1], strict=True))
        assert worst < 1e-5, f"{family} tp, cp = {key}: {losses} vs cp=1 {runs[1, 1]}"


@pytest.mark.slow
def test_data_document_mask_trains_alike_at_cp1_and_cp2_and_differs_from_unmasked(tmp_path):
    """Short JSON records packed into 32-token blocks (several documents per block): with data.document_mask=true,
    Qwen2 at cp=1, at cp=2 (ring) and at tp=2 x cp=2 with the alltoall rotation (2 query heads and 1 kv head per
    tensor-parallel rank: the kv head repeated for both cp ranks) give the same losses, and they differ from unmasked
    packing."""
    import json
    import random

    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    corpus = tmp_path / "records.jsonl"
    corpus.write_text(
        "".join(json.dumps({"text": " ".join(rng.choices(words, k=rng.randint(3, 12)))}) + "\n" for _ in range(400))
    )
    data = ("data=local_text", f"data.source={corpus}", "ckpt_path=null", "model=hf", "model.type=qwen2")
    layouts = {
        "cp1": (),
        "cp2_ring": ("cp=2",),
        "tp2_cp2_alltoall": ("tp=2", "cp=2", "trainer.strategy.context_parallel_rotation=alltoall"),
    }
    masked = {
        name: _losses(tmp_path, f"masked_{name}", *data, *parallel, "data.document_mask=true", steps=4)
        for name, parallel in layouts.items()
    }
    unmasked = _losses(tmp_path, "unmasked", *data, "data.document_mask=false", steps=4)
    for name in ("cp2_ring", "tp2_cp2_alltoall"):
        assert max(abs(a - b) for a, b in zip(masked["cp1"], masked[name], strict=True)) < 1e-5, (name, masked)
    assert max(abs(a - b) for a, b in zip(masked["cp1"], unmasked, strict=True)) > 1e-3, (masked, unmasked)
