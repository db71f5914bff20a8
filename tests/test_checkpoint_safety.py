"""Checkpoints are data, never code: a real pickle planted in `meta.pt` or in DCP's `.metadata`, which would write a
file when unpickled, is refused in one line naming the file and the opt-in by every loader (resume through
train.py, `tp_train.load_checkpoint`, `tp-train-export`), and the file is never written."""

from __future__ import annotations

import os
import pickle
import shutil
import sys
from enum import Enum
from fractions import Fraction
from pathlib import Path, PosixPath

import pytest
import torch

import tp_train
from tests import train_cases
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
    result = train_cases.run(
        [sys.executable, "train.py", "experiment=smoke", "logger=none", "data.max_files=20", f"ckpt_path={planted}",
         f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=env, timeout=300,
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


# ------------------------------------------------------------------------ Enum members pickled by value or by name
# Python 3.11.0-3.11.4 (Debian 12's python3) pickle an Enum member as `getattr(Enum, "NAME")`, every other Python as
# `Enum(value)`. Both forms are forged here, so the tests mean the same on whichever interpreter runs them.


class _EnumPickler(pickle.Pickler):
    """Pickles every Enum member in one `form`: "by value" (`Enum(value)`) or "by name" (`getattr(Enum, name)`)."""

    form = "by value"

    def reducer_override(self, obj):
        if not isinstance(obj, Enum):
            return NotImplemented
        return (getattr, (type(obj), obj.name)) if self.form == "by name" else (type(obj), (obj.value,))


def _enum_pickle_module(form: str):
    """A stand-in for the `pickle` module (torch.save's `pickle_module`) whose Pickler writes Enums in `form`."""
    import types

    return types.SimpleNamespace(Pickler=type("Pickler", (_EnumPickler,), {"form": form}), __name__="pickle")


def _pickled(value, form: str) -> bytes:
    import io

    stream = io.BytesIO()
    _enum_pickle_module(form).Pickler(stream, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return stream.getvalue()


class _Call:
    """Unpickled, it is `func(*args)` (`func` may itself be a `_Call`): how a forged pickle chains calls."""

    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __call__(self):  # pickle insists that what it reduces with is callable
        raise AssertionError("only ever unpickled")

    def __reduce__(self):
        return (self.func, self.args)


@pytest.mark.parametrize("form", ["by value", "by name"])
def test_dcp_metadata_reads_with_its_enum_members_pickled_by_value_or_by_name(form, checkpoint, tmp_path):
    """A checkpoint written under Python 3.11.2 (members by name) loads everywhere, and one written elsewhere (by
    value) loads there: the same `.metadata` in each form reads back equal, and `load_checkpoint` takes it."""
    original = read_metadata(checkpoint)
    copy = tmp_path / "copy.ckpt"
    shutil.copytree(checkpoint, copy)
    data = _pickled(original, form)
    assert (b"getattr" in data) == (form == "by name")  # the form really is the one named
    (copy / ".metadata").write_bytes(data)

    again = read_metadata(copy)
    assert again.state_dict_metadata == original.state_dict_metadata
    assert again.storage_data == original.storage_data
    assert run_on_ranks(_load, 2, str(copy), timeout=300) == [None, None]  # loaded: nothing refused


def test_getattr_in_dcp_metadata_reaches_only_enum_members(checkpoint, tmp_path):
    """The way an unguarded getattr would run code: from an admitted function to its module's globals, to `os`, to
    `os.system`. A file that does so is refused in one line before anything runs; so is a getattr for a name that is
    no member of an admitted Enum, and one on anything else (`os`, `builtins`, another class)."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING
    from torch.serialization import _get_layout

    from tp_train.checkpoint.safe_load import enum_member

    marker = tmp_path / "code-ran"
    module_globals = _Call(getattr, _get_layout, "__globals__")
    os_module = _Call(_Call(getattr, module_globals, "get"), "os")
    payload = _Call(_Call(getattr, os_module, "system"), f"touch {marker}")
    for name, value in [
        ("os-system", payload),
        ("not-a-member", _Call(getattr, _MEM_FORMAT_ENCODING, "__class__")),
        ("not-an-enum", _Call(getattr, PosixPath, "home")),  # an admitted class, not an Enum
    ]:
        planted = tmp_path / f"{name}.ckpt"
        shutil.copytree(checkpoint, planted)
        metadata = read_metadata(checkpoint)
        metadata.planner_data = value
        (planted / ".metadata").write_bytes(pickle.dumps(metadata))
        with pytest.raises(UnsafeCheckpointError) as refused:
            read_metadata(planted)
        message = str(refused.value)
        assert "\n" not in message and f"{planted / '.metadata'}: refused, it names builtins.getattr(" in message
        assert not marker.exists()
    with open(tmp_path / "os-system.ckpt" / ".metadata", "rb") as stream:  # the plant is real: plain pickle runs it
        pickle.load(stream)
    assert marker.exists()

    import builtins

    guarded = enum_member(Path("f"), (_MEM_FORMAT_ENCODING,))
    assert guarded(_MEM_FORMAT_ENCODING, "TORCH_CHANNELS_LAST") is _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST
    for owner, name in [(os, "system"), (builtins, "eval"), (_MEM_FORMAT_ENCODING, "mro"), (PosixPath, "home")]:
        with pytest.raises(UnsafeCheckpointError, match=r"^checkpoint f: refused, it names builtins.getattr\("):
            guarded(owner, name)


class Stage(Enum):
    TRAIN = 0


def test_an_enum_in_meta_pt_is_refused_in_either_form(tmp_path):
    """meta.pt (read with torch's weights_only reader) admits no Enum class: pickled by value or by name, one line."""
    for form in ("by value", "by name"):
        file = tmp_path / f"{form.replace(' ', '-')}.pt"
        torch.save({"stage": Stage.TRAIN}, file, pickle_module=_enum_pickle_module(form))
        expected = "builtins.getattr" if form == "by name" else "Stage"
        with pytest.raises(UnsafeCheckpointError, match=rf"refused, it names .*{expected}"):
            read_extra(file)
