"""Sharded checkpoints: saved at tp=2, they load at tp=1, tp=4 and dp=2 x tp=2 into the same model and optimizer
state (training continues identically), consolidate into the unsharded model, and a save that dies midway leaves
the previous checkpoint loadable.

Everything runs in one spawn of 4 ranks: spawning and importing dominate the cost."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import init_device_mesh

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import next_token_loss
from tests.test_parallelize import MODELS, VOCAB
from tp_train.checkpoint.dcp import load, optimizer_state_dict, save
from tp_train.parallel.sharding import full_state_dict as consolidated_state_dict

MODEL_NAMES = ("gpt", "hf_gpt2", "custom_tp_plan")  # tied + padded vocab; fused Conv1D q/k/v; packed gate/up
WORLD_SIZE = 4
# name -> (dp, tp, pass the 2-D mesh itself rather than its 1-D tensor-parallel dimension). Where dp > 1 with a 1-D
# mesh, the dp replicas are invisible to the checkpoint, as under plain DDP.
SAVE_LAYOUT = ("tp2", (2, 2, False))
LAYOUTS = {"tp1": (4, 1, False), "tp4": (1, 4, False), "dp2_tp2": (2, 2, True)}  # where the checkpoints load
LR = 1e-2


def _mesh(dp: int, tp: int, two_dimensional: bool):
    """The mesh the strategy passes, and the tp group the model is sharded over."""
    mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("data_parallel", "tensor_parallel"))
    return mesh if two_dimensional else mesh["tensor_parallel"], mesh["tensor_parallel"].get_group()


def _build(name: str, seed: int, tp_group, lr: float = LR):
    build, forward = MODELS[name]
    torch.manual_seed(seed)
    model = tp_train.parallelize(build(), tp_group)
    return model, forward, torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _batches(count: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    return [torch.randint(0, VOCAB, (2, 16), generator=generator) for _ in range(count)]


def _train_step(model, forward, optimizer, idx) -> float:
    loss = next_token_loss(forward(model, idx), idx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _snapshot(model, optimizer, group) -> dict[str, torch.Tensor]:
    """The full model state and, gathered, every optimizer state tensor (keyed `optim:<param>:<key>`)."""
    snapshot = {key: tensor.clone() for key, tensor in consolidated_state_dict(model, group).items()}
    specs = {id(param): spec for _, param, spec in tp_train.named_sharded_parameters(model)}
    for name, param in model.named_parameters():
        for key, value in optimizer.state[param].items():
            if id(param) in specs and value.shape == param.shape:
                value = tp_train.unshard_tensor(value, specs[id(param)], group)
            snapshot[f"optim:{name}:{key}"] = value.clone()
    return snapshot


def _padding_max(model, optimizer, tp_group) -> float:
    """The largest |value| in any vocabulary padding row, of the parameters and of Adam's moments."""
    worst = 0.0
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    for _, param, spec in tp_train.named_sharded_parameters(model):
        if spec.padded:
            assert param.shape[0] == -(-spec.sections[0] // tp)
            real = max(0, min(param.shape[0], spec.sections[0] - rank * param.shape[0]))
            for tensor in (param, optimizer.state[param]["exp_avg"], optimizer.state[param]["exp_avg_sq"]):
                worst = max([worst] + tensor[real:].abs().flatten().tolist())
    return worst


def _poison_padding(model, tp_group) -> None:
    rank = dist.get_rank(tp_group)
    with torch.no_grad():
        for _, param, spec in tp_train.named_sharded_parameters(model):
            if spec.padded:
                param[max(0, spec.sections[0] - rank * param.shape[0]) :].fill_(7.0)


def _round_trips(rank, world_size, directory):
    return {**_save_at_tp2(rank, directory), **_load_and_continue(rank, directory)}


def _save_at_tp2(rank, directory):
    """Trains each model two steps, saves it, then records one more step on a third batch."""
    mesh, group = _mesh(*SAVE_LAYOUT[1])
    results = {}
    for name in MODEL_NAMES:
        model, forward, optimizer = _build(name, 0, group)
        first, second, third = _batches(3)
        for idx in (first, second):
            _train_step(model, forward, optimizer, idx)
        save(Path(directory) / name, model, [optimizer], mesh, extra={"global_step": 2, "model": name})
        snapshot = _snapshot(model, optimizer, group)
        loss = _train_step(model, forward, optimizer, third)
        results[name] = {"snapshot": snapshot, "loss": loss, "next_loss": _train_step(model, forward, optimizer, third)}
    results["interrupted"] = _interrupted_save(Path(directory) / "interrupted", mesh, group)
    results["created_state"] = _created_state_differences(mesh, group)
    return results if rank == 0 else {}


OPTIMIZERS = {
    "adam_weight_decay": lambda params: torch.optim.Adam(params, lr=LR, weight_decay=0.1),
    "adamw": lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=0.1),
    "sgd_momentum_weight_decay": lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9, weight_decay=0.1),
}


def _created_state_differences(mesh, group) -> dict[str, float]:
    """optimizer_state_dict creates missing state (to load into); training must go on as from a fresh optimizer."""
    differences = {}
    for name, make_optimizer in OPTIMIZERS.items():
        weights = []
        for create_state in (False, True):
            model, forward, _ = _build("gpt", 0, group)
            optimizer = make_optimizer(model.parameters())
            if create_state:
                optimizer_state_dict(model, optimizer, mesh)
            for idx in _batches(2):
                _train_step(model, forward, optimizer, idx)
            weights.append(consolidated_state_dict(model, group))
        differences[name] = max((weights[0][key] - weights[1][key]).abs().max().item() for key in weights[0])
    return differences


def _interrupted_save(path: Path, mesh, group) -> dict:
    """Saves checkpoint A, then a save that dies after the shards are written, then a complete save B."""
    model, forward, optimizer = _build("custom_tp_plan", 0, group)
    _train_step(model, forward, optimizer, _batches(1)[0])
    save(path, model, [optimizer], mesh, extra={"version": "A"})
    state_a = _snapshot(model, optimizer, group)
    _train_step(model, forward, optimizer, _batches(1)[0])
    # Only the coordinator runs finish (it writes .metadata, after every rank wrote its shards); DCP raises the
    # failure on every rank, as it would report a rank that died.
    with mock.patch.object(FileSystemWriter, "finish", side_effect=RuntimeError("killed while saving")):
        with pytest.raises(CheckpointException):
            save(path, model, [optimizer], mesh, extra={"version": "B"})
    tmp = path.with_name(path.name + ".tmp")
    leftover = sorted(p.name for p in tmp.iterdir()) if tmp.exists() else []
    fresh, _, fresh_optimizer = _build("custom_tp_plan", 1, group)
    extra_a = load(path, fresh, [fresh_optimizer], mesh)
    loaded_a = _snapshot(fresh, fresh_optimizer, group)
    save(path, model, [optimizer], mesh, extra={"version": "B"})  # over the leftovers and over A
    fresh, _, fresh_optimizer = _build("custom_tp_plan", 1, group)
    extra_b = load(path, fresh, [fresh_optimizer], mesh)
    return {
        "leftover": leftover,
        "state_a": state_a,
        "loaded_a": loaded_a,
        "extra_a": extra_a,
        "state_b": _snapshot(model, optimizer, group),
        "loaded_b": _snapshot(fresh, fresh_optimizer, group),
        "extra_b": extra_b,
        "siblings": sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name)),
    }


def _load_and_continue(rank, directory):
    """Loads each tp=2 checkpoint into a differently seeded model at each layout, then takes the same step. The
    dp=2 x tp=2 models are then saved again (from the 2-D mesh) and loaded at tp=4."""
    results = {}
    for layout in LAYOUTS:
        mesh, group = _mesh(*LAYOUTS[layout])
        for name in MODEL_NAMES:
            model, forward, optimizer = _build(name, 1, group, lr=0.5)  # lr comes back from the checkpoint
            params = {param_name: (param, param.data_ptr()) for param_name, param in model.named_parameters()}
            _poison_padding(model, group)
            extra = load(Path(directory) / name, model, [optimizer], mesh)
            in_place = all(
                param is model.get_parameter(param_name) and param.data_ptr() == pointer
                for param_name, (param, pointer) in params.items()
            )
            padding_max = _padding_max(model, optimizer, group)
            snapshot = _snapshot(model, optimizer, group)
            idx = _batches(3)[2]
            with torch.no_grad():
                sharded_logits = forward(model, idx)
            unsharded_logits_error = None
            if rank == 0:  # the consolidated state dict into a plain, differently seeded, unsharded model
                torch.manual_seed(2)
                reference = MODELS[name][0]()
                reference.load_state_dict(consolidated_state_dict(model, group), strict=True)
                with torch.no_grad():
                    unsharded_logits_error = (forward(reference, idx) - sharded_logits).abs().max().item()
            else:
                consolidated_state_dict(model, group)  # a collective
            loss = _train_step(model, forward, optimizer, idx)
            results[layout, name] = {
                "extra": extra,
                "lr": optimizer.param_groups[0]["lr"],
                "in_place": in_place,
                "padding_max": padding_max,
                "snapshot": snapshot if rank == 0 else None,
                "unsharded_logits_error": unsharded_logits_error,
                "loss": loss,
                "next_loss": _train_step(model, forward, optimizer, idx),
            }
            if layout == "dp2_tp2":
                save(Path(directory) / "resaved" / name, model, [optimizer], mesh)
                results["resaved", name] = {"saved": _snapshot(model, optimizer, group)}
    mesh, group = _mesh(*LAYOUTS["tp4"])
    for name in MODEL_NAMES:
        model, _, optimizer = _build(name, 1, group)
        load(Path(directory) / "resaved" / name, model, [optimizer], mesh)
        results["resaved", name]["loaded"] = _snapshot(model, optimizer, group)
    return results


@pytest.fixture(scope="module")
def round_trips(tmp_path_factory) -> list[dict]:
    """Each rank's results (rank 0's alone hold the tp=2 run's and the gathered states)."""
    return run_on_ranks(_round_trips, WORLD_SIZE, str(tmp_path_factory.mktemp("checkpoints")), timeout=300)


def _assert_equal_states(actual: dict, expected: dict, where: str) -> None:
    assert actual.keys() == expected.keys(), where
    for key, tensor in expected.items():
        assert torch.equal(actual[key], tensor), f"{where}: {key} differs by {(actual[key] - tensor).abs().max()}"


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_checkpoint_reshards_model_and_optimizer(round_trips, layout, model_name):
    saved = round_trips[0][model_name]
    _assert_equal_states(round_trips[0][layout, model_name]["snapshot"], saved["snapshot"], f"{layout}/{model_name}")
    assert any(key.endswith(":exp_avg") for key in saved["snapshot"])
    for rank, results in enumerate(round_trips):
        result = results[layout, model_name]
        assert result["in_place"], f"rank {rank}: load replaced a parameter instead of filling it"
        assert result["padding_max"] == 0.0, f"rank {rank}: vocabulary padding rows not zero"
        assert result["lr"] == LR
        assert result["extra"] == {"global_step": 2, "model": model_name}
        # The step after loading is the step the tp=2 run took after saving: same weights, same Adam moments.
        assert abs(result["loss"] - saved["loss"]) < 1e-5, (rank, result["loss"], saved["loss"])
        assert abs(result["next_loss"] - saved["next_loss"]) < 1e-5, (rank, result["next_loss"], saved["next_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_checkpoint_saved_from_2d_mesh_loads_at_tp4(round_trips, model_name):
    result = round_trips[0]["resaved", model_name]
    _assert_equal_states(result["loaded"], result["saved"], f"dp2_tp2 -> tp4 / {model_name}")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_consolidated_state_dict_loads_into_unsharded_model(round_trips, layout):
    for model_name in MODEL_NAMES:
        error = round_trips[0][layout, model_name]["unsharded_logits_error"]
        assert error < 1e-5, f"{layout}/{model_name}: logits differ by {error:.3g}"


@pytest.mark.slow
def test_interrupted_save_leaves_previous_checkpoint(round_trips):
    result = round_trips[0]["interrupted"]
    assert result["leftover"], "the failed save should have left shards in the .tmp directory"
    assert ".metadata" not in result["leftover"]
    _assert_equal_states(result["loaded_a"], result["state_a"], "checkpoint A after a failed save")
    assert result["extra_a"] == {"version": "A"}
    _assert_equal_states(result["loaded_b"], result["state_b"], "checkpoint B replacing A")
    assert result["extra_b"] == {"version": "B"}
    assert result["siblings"] == ["interrupted"]  # no .tmp or .old left behind
    assert not torch.equal(result["state_a"]["embed.weight"], result["state_b"]["embed.weight"])


@pytest.mark.slow
def test_created_optimizer_state_trains_like_fresh_state(round_trips):
    for name, difference in round_trips[0]["created_state"].items():
        assert difference == 0.0, f"{name}: weights differ by {difference:.3g} after two steps"
