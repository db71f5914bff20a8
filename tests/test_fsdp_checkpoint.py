"""Checkpoints under sharded data parallelism (`data_parallel="fsdp"`): a dp2 x tp2 FSDP2 checkpoint validates the
same at one device, at tp=2 and at dp2 x tp2 with DDP; training resumes from it exactly; and the DCP layout is the
same with and without FSDP2, including tensors FSDP2 splits along their tensor-parallel dimension (biases), and
exports to Hugging Face."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.device_mesh import init_device_mesh

from models.gpt import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit, validate
from tests.parity import next_token_loss
from tests.test_parallelize import ATOL, VOCAB, _hf_gpt2, _hf_llama
from tp_train.checkpoint import dcp as checkpoint_io
from tp_train.parallel.mesh import DATA_PARALLEL, TENSOR_PARALLEL
from tp_train.parallel.sharding import local_part
from tp_train.plan.parallelize import parallelize
from tp_train.tools.export import export_hugging_face
from tp_train.training.data_parallel import fully_shard_data_parallel

EPOCH = 4  # batches per epoch: the checkpoint after step 4 ends an epoch
EXPORTED = {"gpt2": _hf_gpt2, "llama": _hf_llama}
IDX = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _train_and_save(rank, world_size, path):
    fit(2, 6, data_parallel="fsdp", save_to=path)
    return validate(2, path, "fsdp")


def _validate(rank, world_size, tp, path):
    return validate(tp, path)


def test_fsdp_checkpoint_validates_the_same_at_one_device_tp2_and_dp2_tp2_ddp(tmp_path):
    path = str(tmp_path / "fsdp.ckpt")
    val_fsdp = run_on_ranks(_train_and_save, 4, path, timeout=300)[0]
    val_one_device = run_on_ranks(_validate, 1, 1, path)[0]
    val_tp2 = run_on_ranks(_validate, 2, 2, path)[0]
    val_dp2_tp2 = run_on_ranks(_validate, 4, 2, path, timeout=300)[0]
    print(f"val loss: fsdp {val_fsdp}, one device {val_one_device}, tp2 {val_tp2}, dp2 x tp2 ddp {val_dp2_tp2}")
    for other in (val_one_device, val_tp2, val_dp2_tp2):
        assert other == pytest.approx(val_fsdp, abs=1e-5)
    untrained = run_on_ranks(_validate_untrained, 1)[0]
    assert abs(untrained - val_fsdp) > 1e-2  # the checkpoint, not the init, decided the loss


def _validate_untrained(rank, world_size):
    import tests.lightning_helpers as helpers

    torch.manual_seed(123)
    trainer = helpers.make_trainer(1)
    (metrics,) = trainer.validate(helpers.LitLM(), helpers.loader(1, 3, seed=99), verbose=False)
    return metrics["val_loss"]


def _straight(rank, world_size):
    return fit(2, 8, data_steps=EPOCH, data_parallel="fsdp")[1].losses


def _interrupted(rank, world_size, directory):
    every_4 = ModelCheckpoint(dirpath=directory, every_n_train_steps=4, save_top_k=-1, filename="{step}")
    first = fit(2, 4, data_steps=EPOCH, data_parallel="fsdp", callbacks=[every_4], enable_checkpointing=True)
    second = fit(2, 8, data_steps=EPOCH, data_parallel="fsdp", ckpt_path=f"{directory}/step=4.ckpt")
    return first[1].losses, second[1].losses


def test_fsdp_resume_gives_the_same_losses_as_training_straight_through(tmp_path):
    straight = run_on_ranks(_straight, 4, timeout=300)[0]
    first, second = run_on_ranks(_interrupted, 4, str(tmp_path), timeout=300)[0]
    assert len(first) == 4 and len(second) == 4
    assert first + second == pytest.approx(straight, abs=1e-5)


def _gpt(seed: int, mesh, fsdp: bool):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=67, block_size=8, n_layer=2, n_head=4, n_embd=16))  # 67: a padded vocabulary
    parallelize(model, mesh[TENSOR_PARALLEL], verify=False)
    if fsdp:
        fully_shard_data_parallel(model, [model], mesh[DATA_PARALLEL])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, 67, (2, 8), generator=torch.Generator().manual_seed(seed))
    model(idx).sum().backward()
    optimizer.step()
    return model, optimizer


def _tensor_parallel_state(model, optimizer) -> dict[str, torch.Tensor]:
    """Every parameter's and AdamW state's tensor-parallel shard (gathered over dp under FSDP2)."""
    whole = {}
    for name, param in model.named_parameters():
        whole[name] = param.full_tensor() if hasattr(param, "full_tensor") else param.detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            value = optimizer.state[param][key]
            whole[f"{name}/{key}"] = value.full_tensor() if hasattr(value, "full_tensor") else value.clone()
    return whole


def _round_trip(rank, world_size, path):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    saved, saved_optimizer = _gpt(0, mesh, fsdp=True)
    # FSDP2 split a column-parallel bias along its tensor-parallel dim: the gathered-copy path is exercised.
    assert saved.blocks[0].mlp.fc.bias.placements[0].dim == 0
    assert saved.blocks[0].mlp.fc.weight.placements[0].dim == 1
    checkpoint_io.save(path, saved, [saved_optimizer], mesh)
    expected = _tensor_parallel_state(saved, saved_optimizer)
    differences = {}
    for fsdp in (False, True):
        model, optimizer = _gpt(1, mesh, fsdp)  # other weights and states, to be overwritten
        checkpoint_io.load(path, model, [optimizer], mesh)
        loaded = _tensor_parallel_state(model, optimizer)
        differences[fsdp] = max((loaded[k] - v).abs().max().item() for k, v in expected.items())
        pieces = sum(local_part(p).numel() for p in model.parameters())
        assert (pieces < sum(v.numel() for k, v in expected.items() if "/" not in k)) == fsdp
    return differences


def test_fsdp_and_ddp_checkpoints_share_one_layout_biases_included(tmp_path):
    for differences in run_on_ranks(_round_trip, 4, str(tmp_path / "gpt.ckpt"), timeout=300):
        assert differences == {False: 0.0, True: 0.0}


def _hugging_face_fsdp_save(rank, world_size, directory):
    """One SGD step of GPT-2 (tied, padded vocabulary, Conv1D, fused q/k/v) and Llama at dp2 x tp2 under FSDP2,
    then a checkpoint; returns the logits after the step."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    logits = {}
    for name, build in EXPORTED.items():
        torch.manual_seed(0)
        model = parallelize(build(), mesh[TENSOR_PARALLEL])
        fully_shard_data_parallel(model, [model], mesh[DATA_PARALLEL])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        next_token_loss(model(input_ids=IDX).logits, IDX).backward()
        optimizer.step()
        checkpoint_io.save(Path(directory) / name, model, [optimizer], mesh)
        with torch.no_grad():
            logits[name] = model(input_ids=IDX).logits
    return logits


def test_an_fsdp_checkpoint_exports_to_hugging_face(tmp_path):
    from transformers import AutoModelForCausalLM

    trained = run_on_ranks(_hugging_face_fsdp_save, 4, str(tmp_path), timeout=300)[0]
    for name, build in EXPORTED.items():
        out = export_hugging_face(tmp_path / name, tmp_path / f"{name}_hf", config=build().config)
        exported = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            error = (exported(input_ids=IDX).logits - trained[name]).abs().max().item()
        assert error < ATOL, (name, error)
