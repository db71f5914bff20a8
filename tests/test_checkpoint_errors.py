"""A missing, truncated, corrupt or incompatible checkpoint is refused with one line naming the file and the
mismatch, before anything is loaded, and the checkpoint is left as it was."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import next_token_loss
from tests.test_parallelize import SwiGLUModel
from tp_train.checkpoint.dcp import load, save
from tp_train.errors import CheckpointError


def _build(dim: int = 32, hidden: int = 48, vocab: int = 101, plan: dict | None = None):
    torch.manual_seed(0)
    # "Another plan" splits gate_up plainly: a different function, which verification would refuse before the
    # checkpoint check this test is about.
    model = tp_train.parallelize(
        SwiGLUModel(vocab=vocab, dim=dim, hidden=hidden),
        dist.group.WORLD,
        plan=plan,
        verify=None if plan is None else False,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def _damage(good: Path, case: str) -> Path:
    """A copy of the checkpoint `good`, damaged as `case` says (rank 0 only)."""
    path = good.with_name(case)
    if case == "garbage_file":
        path.write_bytes(b"\x00not a checkpoint\xff" * 64)
        return path
    shutil.copytree(good, path)
    if case == "missing_metadata":
        (path / ".metadata").unlink()
    elif case == "garbage_metadata":
        (path / ".metadata").write_bytes(b"garbage" * 100)
    elif case == "truncated_shard":
        shard = path / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif case == "missing_shard":
        (path / "__0_0.distcp").unlink()
    elif case == "corrupt_shard":  # same size, scrambled bytes: only reading the tensors finds it
        shard = path / "__0_0.distcp"
        shard.write_bytes(bytes(b ^ 0x5A for b in shard.read_bytes()))
    elif case == "corrupt_meta_pt":
        (path / "meta.pt").write_bytes(b"garbage")
    return path


# case -> (what the error must say, the model to load into)
CASES = {
    "garbage_file": ("garbage_file: a file, not a checkpoint directory", {}),
    "missing_metadata": ("missing_metadata: no .metadata file, so the save never finished", {}),
    "garbage_metadata": ("garbage_metadata/.metadata: unreadable", {}),
    "truncated_shard": ("truncated_shard/__1_0.distcp: truncated,", {}),
    "missing_shard": ("missing_shard/__0_0.distcp: missing (.metadata lists it)", {}),
    "corrupt_shard": ("corrupt_shard: unreadable, reading its tensors failed with UnpicklingError", {}),
    "corrupt_meta_pt": ("corrupt_meta_pt/meta.pt: unreadable,", {}),
    "other_hidden_size": ("good: model.layers.0.mlp.gate_up.weight/section0 has shape [48, 32] there but [64, 32]",
                          {"hidden": 64}),
    "other_vocab": ("good: model.embed.weight has shape [101, 32] there but [99, 32] in this model", {"vocab": 99}),
    # [gate; up] split as one tensor rather than two sections: the same parameters, another layout
    "other_plan": ("good: model.layers.0.mlp.gate_up.weight is not there (and 5 more of this model's entries)",
                   {"plan": {**SwiGLUModel.tp_plan, "layers.*.mlp.gate_up": "colwise"}}),
}  # fmt: skip


def _train(model, optimizer, steps: int = 2) -> None:
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        idx = torch.randint(0, model.embed.num_embeddings, (2, 8), generator=generator)
        next_token_loss(model(idx), idx).backward()
        optimizer.step()
        optimizer.zero_grad()


def _state(model, optimizer) -> dict[str, torch.Tensor]:
    """Copies of the model's parameters and the optimizer's per-parameter state (Adam's moments, step)."""
    state = {f"param:{name}": param.detach().clone() for name, param in model.named_parameters()}
    for name, param in model.named_parameters():
        for key, value in optimizer.state.get(param, {}).items():
            state[f"optimizer:{name}:{key}"] = torch.as_tensor(value).clone()
    return state


def _digest(path: Path) -> dict[str, tuple[str, int]]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(f): (hashlib.sha256(f.read_bytes()).hexdigest(), f.stat().st_mtime_ns) for f in files}


def _refusals(rank, world_size, directory):
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,), mesh_dim_names=("tensor_parallel",))
    good = Path(directory) / "good"
    model, optimizer = _build()
    save(good, model, [optimizer], mesh, extra={"step": 1})
    if rank == 0:
        for case in CASES:
            _damage(good, case)
    dist.barrier()
    results = {}
    for case, (_, sizes) in CASES.items():
        path = good if case.startswith("other_") else good.with_name(case)
        before = _digest(path)
        model, optimizer = _build(**sizes)
        _train(model, optimizer)  # unlike the checkpoint's (untrained) model: a partial load would show
        before_load = _state(model, optimizer)
        try:
            load(path, model, [optimizer], mesh)
            message = None
        except CheckpointError as error:
            message = str(error)
        after_load = _state(model, optimizer)
        unchanged = before_load.keys() == after_load.keys() and all(
            torch.equal(before_load[key], after_load[key]) for key in before_load
        )
        results[case] = {"message": message, "files_unchanged": _digest(path) == before, "model_unchanged": unchanged}
        dist.barrier()
    saved = _state(*_build())  # the checkpoint holds the untrained model
    model, optimizer = _build()
    _train(model, optimizer)
    # The control: a load that succeeds does change the trained model, back to the checkpoint's weights.
    loaded = load(good, model, [optimizer], mesh) == {"step": 1}
    results["good_loads"] = loaded and all(
        torch.equal(value, _state(model, optimizer)[key]) for key, value in saved.items()
    )
    return results


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    return run_on_ranks(_refusals, 2, str(tmp_path_factory.mktemp("checkpoints")), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_bad_checkpoint_is_refused_in_one_line_and_left_as_it_was(refusals, case):
    expected, _ = CASES[case]
    for rank, results in enumerate(refusals):
        result = results[case]
        assert result["message"] is not None, f"rank {rank}: {case} loaded"
        assert expected in result["message"] and "\n" not in result["message"], (rank, result["message"])
        assert result["files_unchanged"], f"rank {rank}: loading {case} changed its files"
        if case != "corrupt_shard":  # found before DCP reads any tensor
            assert result["model_unchanged"], f"rank {rank}: a refused {case} changed the trained model or optimizer"
        assert results["good_loads"]
