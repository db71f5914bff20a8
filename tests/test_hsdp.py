"""HSDP through `python train.py data_parallel=fsdp dp=4 dp_shard=2` (FSDP2 on a (replicate, shard) mesh: 2 groups
of 2 ranks, each group holding the model split between its ranks, the groups replicating it) on gloo ranks: the
logged losses, gradient norms and final parameters of one process at the same global batch (data.batch_size x dp),
each rank holding 1/dp_shard of the parameters (not 1/dp), and checkpoints that move between HSDP and one device
(DDP at dp=1) in both directions with the losses of the unbroken run; HSDP with tp=2 inside each shard group (8
ranks) alike, and HSDP under a pipeline of 2 virtual stages per rank (8 ranks). In float64 (see PARAMETER_TOLERANCE).
And the first pair in float32 too. One test: its ten runs share the cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from models.gpt import GPT, GPTConfig
from tests.test_pipeline_train import _train
from tp_train.checkpoint.checks import check_files
from tp_train.checkpoint.safe_load import SafeFileSystemReader
from tp_train.tools.memory import parameters_per_rank

BATCH, DP, DP_SHARD = 8, 4, 2  # the global batch, and HSDP's data-parallel ranks and ranks per shard group
# In float64: in float32, AdamW's division by the root of its second moment turns the rounding of a gradient summed
# in another order (over 8 sequences in one matmul, or 2 per rank then across ranks) into parameter differences of
# 1.6e-5 (HSDP) and 5.0e-5 (with tp=2) after 4 steps on an AVX-512 machine, under 1e-5 on others; in float64 they are
# 2e-15, so a tolerance of 1e-10 leaves nothing to rounding. The losses are compared as logged (in float32).
PARAMETER_TOLERANCE = 1e-10
SMALL = ["precision=64", "tp=1", "data.max_files=20", "data.vocab_size=300", "data.block_size=32",
         "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "+callbacks.checkpoint.save_top_k=-1"]  # fmt: skip  # keeps step 2's checkpoint for the resumes
ONE_DEVICE = ["dp=1", f"data.batch_size={BATCH}"]
HSDP = [f"dp={DP}", f"dp_shard={DP_SHARD}", "data_parallel=fsdp", f"data.batch_size={BATCH // DP}"]
SERIES = ("train/loss", "train/grad_norm")  # the norm: clipping (gradient_clip_val=1.0) counts each element once


def _parameters(run: Path, checkpoint: str = "last.ckpt") -> dict[str, torch.Tensor]:
    """The model's tensors in one of the run's checkpoints, whole, by DCP key (the layout is the same at any
    parallelism), read in this process."""
    path = run / "checkpoints" / checkpoint
    stored = check_files(path).state_dict_metadata
    tensors = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in stored.items()
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)
    }
    dcp.load(tensors, storage_reader=SafeFileSystemReader(path), no_dist=True)
    return tensors


def _worst(metrics: dict, reference: dict, steps: list[int]) -> float:
    return max(abs(metrics[name][step] - reference[name][step]) for name in SERIES for step in steps)


@pytest.mark.slow
def test_hsdp_trains_like_one_device_holds_half_and_resumes_across_layouts(tmp_path):
    one_device = _train(tmp_path, "one_device", [*SMALL, *ONE_DEVICE])
    hsdp = _train(tmp_path, "hsdp", [*SMALL, *HSDP])
    for name in SERIES:
        assert sorted(hsdp[name]) == [0, 1, 2, 3], (name, hsdp[name])
    worst_loss = _worst(hsdp, one_device, [0, 1, 2, 3])
    whole, own = _parameters(tmp_path / "one_device"), _parameters(tmp_path / "hsdp")
    worst_parameter = max((whole[name] - own[name]).abs().max().item() for name in whole)
    print(f"HSDP dp={DP} dp_shard={DP_SHARD} against one device: losses and norms {worst_loss:.2e}, "
          f"parameters {worst_parameter:.2e}")  # fmt: skip
    assert worst_loss < 1e-5 and worst_parameter < PARAMETER_TOLERANCE
    assert whole.keys() == own.keys()
    at_step_2 = _parameters(tmp_path / "hsdp", "step000002.ckpt")  # the last steps moved them: not a stale save
    assert max((own[name] - at_step_2[name]).abs().max().item() for name in own) > 1e-4
    # with tensor parallelism inside each shard group: 8 ranks, (replicate 2, shard 2, tp 2)
    with_tp = _train(
        tmp_path, "hsdp_tp2", [*(setting for setting in SMALL if setting != "tp=1"), *HSDP, "tp=2"], ranks=8
    )
    worst_loss = _worst(with_tp, one_device, [0, 1, 2, 3])
    with_tp_own = _parameters(tmp_path / "hsdp_tp2")
    worst_parameter = max((whole[name] - with_tp_own[name]).abs().max().item() for name in whole)
    print(f"HSDP x tp=2: losses and norms {worst_loss:.2e}, parameters {worst_parameter:.2e}")
    assert worst_loss < 1e-5 and worst_parameter < PARAMETER_TOLERANCE

    # Rank 0 holds its half of every parameter (FSDP2's larger piece of an odd split), not a quarter.
    summary = json.loads((tmp_path / "hsdp" / "summary.json").read_text())
    model = GPT(_config())
    assert summary["parameters"] == sum(p.numel() for p in model.parameters())
    # the run's logged hyperparameters (W&B's config; here the CSV logger's) name the strategy's mode
    hparams = yaml.safe_load(next((tmp_path / "hsdp").glob("csv/version_*/hparams.yaml")).read_text())
    assert (hparams["data_parallel"], hparams["dp_shard"]) == ("fsdp", DP_SHARD), hparams["data_parallel"]
    assert summary["parameters_on_rank"] == parameters_per_rank(model, tp=1, dp=DP_SHARD, data_parallel="fsdp")
    assert summary["parameters_on_rank"] > parameters_per_rank(model, tp=1, dp=DP, data_parallel="fsdp")

    step_2 = "checkpoints/step000002.ckpt"
    to_one_device = _train(tmp_path, "to_one_device", [*SMALL, *ONE_DEVICE, f"ckpt_path={tmp_path / 'hsdp' / step_2}"])
    to_hsdp = _train(tmp_path, "to_hsdp", [*SMALL, *HSDP, f"ckpt_path={tmp_path / 'one_device' / step_2}"])
    for resumed in (to_one_device, to_hsdp):  # steps 3 and 4: the loaded weights, then AdamW's loaded state
        assert all(sorted(resumed[name]) == [2, 3] for name in SERIES), resumed
        assert _worst(resumed, one_device, [2, 3]) < 1e-5, (resumed, one_device)

    # In float32, as users train: the logged losses and gradient norms (its parameters: PARAMETER_TOLERANCE)
    float32 = [setting for setting in SMALL if setting != "precision=64"]
    one_device_32 = _train(tmp_path, "one_device_float32", [*float32, *ONE_DEVICE])
    worst_loss = _worst(_train(tmp_path, "hsdp_float32", [*float32, *HSDP]), one_device_32, [0, 1, 2, 3])
    print(f"HSDP in float32: losses and norms {worst_loss:.2e}")
    assert worst_loss < 1e-5

    # HSDP under a pipeline of 2 virtual stages per rank (interleaved 1F1B): 8 ranks (pp 2, replicate 2, shard 2),
    # each rank's two stage views sharded by FSDP2 apart, against one device with the same 4 blocks
    blocks = ["model.config.n_layer=4"]
    one_device_4 = _train(tmp_path, "one_device_4_blocks", [*SMALL, *ONE_DEVICE, *blocks])
    interleaved = ["pp=2", "trainer.strategy.pipeline_schedule=interleaved_1f1b",
                   "trainer.strategy.pipeline_virtual_stages=2"]  # fmt: skip
    virtual = _train(tmp_path, "hsdp_pp2_virtual", [*SMALL, *HSDP, *blocks, *interleaved], ranks=8)
    worst_loss = _worst(virtual, one_device_4, [0, 1, 2, 3])
    whole, own = _parameters(tmp_path / "one_device_4_blocks"), _parameters(tmp_path / "hsdp_pp2_virtual")
    assert whole.keys() == own.keys()
    worst_parameter = max((whole[name] - own[name]).abs().max().item() for name in whole)
    print(f"HSDP x pp=2 x 2 virtual stages: losses and norms {worst_loss:.2e}, parameters {worst_parameter:.2e}")
    assert worst_loss < 1e-5 and worst_parameter < PARAMETER_TOLERANCE


def _config() -> GPTConfig:
    """conf/model/gpt_tiny.yaml under experiment=smoke, at SMALL's data sizes."""
    return GPTConfig(vocab_size=300, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0, bias=True)
