"""Checkpoints are data, never code: a real pickle planted in `meta.pt` or in DCP's `.metadata`, which would write a
file when unpickled, is refused in one line naming the file and the opt-in by every loader (resume through
train.py, `tp_train.load_checkpoint`, `tp-train-export`), and the file is never written."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.test_parallelize import _hf_llama
from tp_train.checkpoint.dcp import HUGGING_FACE_CONFIG_KEY
from tp_train.checkpoint.safe_load import read_extra, read_metadata
from tp_train.errors import CheckpointError, UnsafeCheckpointError
from tp_train.tools.export import main as export_main

ROOT = Path(__file__).resolve().parents[1]
PLANTS = ["meta.pt", ".metadata"]


class WritesAFile:
    """Unpickled, it opens `path` for writing: the file appearing is the proof that code ran."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _save(rank, world_size, directory):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = _hf_llama()
    extra = {"epoch": 0, "global_step": 1, HUGGING_FACE_CONFIG_KEY: model.config.to_dict()}
    mesh = init_device_mesh("cpu", (world_size,))
    model = tp_train.parallelize(model, mesh)
    tp_train.save_checkpoint(directory, model, [torch.optim.AdamW(model.parameters())], mesh, extra=extra)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A real tp=2 checkpoint of a Hugging Face Llama with its AdamW state (byte items included)."""
    path = tmp_path_factory.mktemp("saved") / "good.ckpt"
    run_on_ranks(_save, 2, str(path), timeout=300)
    return path


def _plant(good: Path, where: str, marker: Path) -> Path:
    """A copy of `good` whose `where` file unpickles to code that writes `marker`, as an attacker would make it:
    the real content kept, with the payload inside."""
    planted = good.with_name(f"planted{where}")
    shutil.rmtree(planted, ignore_errors=True)
    shutil.copytree(good, planted)
    if where == "meta.pt":
        extra = read_extra(good / "meta.pt")
        extra["callbacks"] = {"payload": WritesAFile(marker)}
        torch.save(extra, planted / "meta.pt")
    else:
        metadata = read_metadata(good)
        metadata.planner_data = WritesAFile(marker)
        (planted / ".metadata").write_bytes(pickle.dumps(metadata))
    return planted


def _one_line_refusal(message: str, planted: Path, where: str) -> None:
    assert "\n" not in message.strip(), message
    assert f"{planted / where}: refused" in message and "io.open" in message, message  # what open() pickles as
    assert "trust_checkpoint=true" in message, message


def _load(rank, world_size, path):
    from torch.distributed.device_mesh import init_device_mesh

    model = tp_train.parallelize(_hf_llama(), init_device_mesh("cpu", (world_size,)))
    try:
        tp_train.load_checkpoint(path, model, [], init_device_mesh("cpu", (world_size,)))
    except UnsafeCheckpointError as error:
        return str(error)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("where", PLANTS)
def test_a_planted_pickle_is_refused_by_every_loader_and_never_runs(where, checkpoint, tmp_path, capsys):
    marker = tmp_path / "code-ran"
    planted = _plant(checkpoint, where, marker)
    with open(planted / where, "rb") as stream:  # the plant is real: a plain unpickler runs it
        torch.load(stream, weights_only=False) if where == "meta.pt" else pickle.load(stream)
    assert marker.exists()
    marker.unlink()

    # load_checkpoint, on ranks
    message = run_on_ranks(_load, 2, str(planted), timeout=300)[0]
    assert not marker.exists()
    _one_line_refusal(message, planted, where)

    # tp-train-export
    with pytest.raises(SystemExit) as exit_status:
        export_main([str(planted), str(tmp_path / "exported")])
    assert exit_status.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: checkpoint ")
    _one_line_refusal(line, planted, where)
    assert not marker.exists() and not (tmp_path / "exported").exists()

    # resume: python train.py ckpt_path=...
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    result = subprocess.run(
        [sys.executable, "train.py", "experiment=smoke", "logger=none", "data.max_files=20", f"ckpt_path={planted}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: ckpt_path: checkpoint "), errors
    _one_line_refusal(errors[0], planted, where)
    assert not marker.exists()


def test_the_saved_checkpoint_reads_as_data_and_more_than_data_needs_the_opt_in(checkpoint, tmp_path):
    """What tp_train writes reads back as data (numpy's random state included); a value that is not data (here a
    harmless Fraction) is refused, or read with the explicit opt-in."""
    import numpy

    extra = read_extra(checkpoint / "meta.pt")
    assert extra["global_step"] == 1 and HUGGING_FACE_CONFIG_KEY in extra
    assert read_metadata(checkpoint).state_dict_metadata
    with_array = tmp_path / "array.pt"
    torch.save({"numpy": numpy.random.get_state()}, with_array)  # Lightning's RNG callback state holds this
    assert read_extra(with_array)["numpy"][0] == "MT19937"
    odd = tmp_path / "fraction.pt"
    torch.save({"value": Fraction(1, 3)}, odd)
    with pytest.raises(UnsafeCheckpointError, match=r"fraction.pt: refused, it names fractions.Fraction"):
        read_extra(odd)
    assert read_extra(odd, trust_checkpoint=True)["value"] == Fraction(1, 3)
    with pytest.raises(CheckpointError, match="unreadable"):
        (tmp_path / "garbage.pt").write_bytes(b"\x00garbage")
        read_extra(tmp_path / "garbage.pt")


def _save_odd_metadata(rank, world_size, directory):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    model = tp_train.parallelize(_hf_llama(), mesh)
    try:
        tp_train.save_checkpoint(directory, model, [], mesh, extra={"callbacks": {"mine": Fraction(1, 3)}})
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.slow
def test_saving_metadata_that_would_not_read_back_as_data_is_refused_at_save(tmp_path):
    message = run_on_ranks(_save_odd_metadata, 1, str(tmp_path / "odd.ckpt"), timeout=300)[0]
    assert message.startswith("checkpoint metadata 'callbacks' holds fractions.Fraction"), message
    assert not (tmp_path / "odd.ckpt").exists()


def test_pretrained_weights_are_read_from_safetensors_only(tmp_path):
    """A model directory holding only a pickled pytorch_model.bin (here planted) is refused by both pretrained
    loaders, the sharded one (`load_pretrained`'s `weight_files`) and `from_pretrained`, and nothing in it runs."""
    from models.hf import hugging_face_causal_lm
    from tp_train.app.preflight import _check_pretrained
    from tp_train.checkpoint.pretrained import weight_files
    from tp_train.errors import ConfigError

    model, marker = _hf_llama(), tmp_path / "code-ran"
    model.config.save_pretrained(tmp_path / "model")
    torch.save({**model.state_dict(), "payload": WritesAFile(marker)}, tmp_path / "model" / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="holds pytorch_model.bin, pickled weights that could run code"):
        weight_files(tmp_path / "model")
    with pytest.raises(ConfigError, match=r"^model.path=.*model: pretrained weights: .* reads safetensors only"):
        _check_pretrained({"path": str(tmp_path / "model")})
    with pytest.raises(OSError):  # transformers, asked for safetensors only, finds none
        hugging_face_causal_lm(path=str(tmp_path / "model"))
    assert not marker.exists()
