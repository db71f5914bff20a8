"""Reading a checkpoint as data, never as code."""

from __future__ import annotations

import io
import pickle
from enum import Enum
from pathlib import Path
from typing import Any

import numpy
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
)

from tp_train.errors import CheckpointError, UnsafeCheckpointError, first_line

METADATA_FILE = ".metadata"  # DCP's index of every tensor and where it is stored
OPT_IN = "trust_checkpoint=true"  # how a user reads a checkpoint of their own that holds more than data

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_METADATA, name)
    for name in (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}  # fmt: skip
# The Enums `.metadata` may hold: their members are admitted pickled by value (the class, called) or by name
# (`builtins.getattr`, read as `enum_member`).
_METADATA_ENUMS = (_MEM_FORMAT_ENCODING,)
# numpy's random state (Lightning's `_collect_rng_states`) is a uint32 array: rebuilt as an array, nothing else.
_ARRAY_GLOBALS = [numpy.ndarray, numpy.dtype, numpy.dtypes.UInt32DType]


def refusal(file: Path, reason: str) -> UnsafeCheckpointError:
    """The one line for a checkpoint file that holds more than data."""
    return UnsafeCheckpointError(
        f"checkpoint {file}: refused, {reason}; it could run code when read. Load only checkpoints you trust, "
        f"with {OPT_IN}"
    )


def enum_member(file: Path, enums: tuple[type[Enum], ...]):
    """What `builtins.getattr` reads as in a pickle from `file`: `(one of enums, a member's name)` gives that member."""

    def getattr_enum_member(owner: Any, name: Any) -> Enum:
        if any(owner is enum for enum in enums) and isinstance(name, str) and name in owner.__members__:
            return owner[name]
        owner_name = getattr(owner, "__qualname__", None) or type(owner).__qualname__
        raise refusal(file, f"it names builtins.getattr({owner_name}, {name!r}), which is not a member of its Enums")

    return getattr_enum_member


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream, file: Path) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):  # an Enum member pickled by name (see the module docstring)
            return enum_member(self.file, _METADATA_ENUMS)
        raise refusal(self.file, f"it names {module}.{name}, which is not DCP metadata")


def read_metadata(path: Path, trust_checkpoint: bool = False) -> Metadata:
    """DCP's `.metadata` of the checkpoint directory `path`, unpickled with DCP's metadata classes only."""
    file = path / METADATA_FILE
    with open(file, "rb") as stream:
        return pickle.load(stream) if trust_checkpoint else _MetadataUnpickler(stream, file).load()


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader, reading `.metadata` with `read_metadata` (no code runs)."""

    def __init__(self, path: str | Path, trust_checkpoint: bool = False) -> None:
        super().__init__(path)
        self.trust_checkpoint = trust_checkpoint

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP metadata files are not read by tp_train")
        metadata = read_metadata(Path(self.path), self.trust_checkpoint)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading the values stored as bytes with `torch.load(weights_only=True)`."""

    def __init__(self, trust_checkpoint: bool = False) -> None:
        super().__init__()
        self.trust_checkpoint = trust_checkpoint

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = _load(value, self.trust_checkpoint)  # where DefaultLoadPlanner puts it
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def check_bytes(path: Path, metadata: Metadata, trust_checkpoint: bool = False) -> None:
    """Every value DCP stored as bytes reads as data (before `dcp.load` reads any of it, or any tensor)."""
    if trust_checkpoint:
        return
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, BytesStorageMetadata):
            continue
        info = metadata.storage_data[MetadataIndex(key)]
        file = path / info.relative_path
        with open(file, "rb") as stream:
            stream.seek(info.offset)
            data = io.BytesIO(stream.read(info.length))
        unsafe = _unsafe_globals(file, data)
        if unsafe:
            raise refusal(file, f"its value for {key} names {', '.join(unsafe)}")


def read_extra(file: Path, trust_checkpoint: bool = False) -> dict:
    """The metadata `tp_train.checkpoint.dcp.save` wrote to `meta.pt` (plain data, see the module docstring)."""
    with open(file, "rb") as stream:
        data = io.BytesIO(stream.read())
    if not trust_checkpoint:
        unsafe = _unsafe_globals(file, data)
        if unsafe:
            raise refusal(file, f"it names {', '.join(unsafe)}")
    try:
        return _load(data, trust_checkpoint)
    except Exception as error:  # noqa: BLE001 - whatever a damaged file raises (pickle, zip, torch)
        raise CheckpointError(f"checkpoint {file}: unreadable, {first_line(error)}") from None


def unsafe_globals(value: Any) -> list[str]:
    """What `value`, once saved with `torch.save`, would name beyond data (empty for what `read_extra` reads)."""
    data = io.BytesIO()
    torch.save(value, data)
    return _unsafe_globals(Path("<memory>"), data)


def _load(data: io.BytesIO, trust_checkpoint: bool) -> Any:
    data.seek(0)
    if trust_checkpoint:
        return torch.load(data, weights_only=False)
    with torch.serialization.safe_globals([numpy._core.multiarray._reconstruct, *_ARRAY_GLOBALS]):
        return torch.load(data, weights_only=True)


def _unsafe_globals(file: Path, data: io.BytesIO) -> list[str]:
    """What the `torch.save` data in `data` names beyond plain data and numpy arrays (found without unpickling)."""
    data.seek(0)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(data)
        return [name for name in names if name not in _array_global_names()]
    except Exception as error:  # noqa: BLE001 - not a torch.save zip file at all
        raise CheckpointError(f"checkpoint {file}: unreadable, {type(error).__name__}: {error}") from None
    finally:
        data.seek(0)


def _array_global_names() -> set[str]:
    globals_ = [numpy._core.multiarray._reconstruct, *_ARRAY_GLOBALS]
    return {f"{g.__module__}.{g.__qualname__}" for g in globals_}
