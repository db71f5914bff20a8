"""Checks that a checkpoint directory can be loaded, before anything is loaded from it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from tp_train.checkpoint.safe_load import METADATA_FILE, check_bytes, read_metadata
from tp_train.errors import CheckpointError, first_line


def check_files(path: str | Path, trust_checkpoint: bool = False) -> Metadata:
    """Returns the DCP metadata of the checkpoint directory `path` once its files are all there, whole, and hold
    only data (`tp_train.checkpoint.safe_load`; `trust_checkpoint` reads them as torch would)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path}: no such file or directory")
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path}: a file, not a checkpoint directory (tp_train saves directories)")
    if not (path / METADATA_FILE).exists():
        raise CheckpointError(
            f"checkpoint {path}: no {METADATA_FILE} file, so the save never finished (a save killed while replacing "
            f"a checkpoint leaves the previous one at {path.name}.old)"
        )
    try:
        metadata = read_metadata(path, trust_checkpoint)
    except CheckpointError:
        raise
    except Exception as error:  # noqa: BLE001 - whatever unpickling raises, the file is damaged
        raise CheckpointError(f"checkpoint {path / METADATA_FILE}: unreadable, {first_line(error)}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path / METADATA_FILE}: not DCP metadata ({type(metadata).__name__})")
    needed: dict[str, int] = {}  # file -> bytes the metadata says it holds at least
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {file}: missing ({METADATA_FILE} lists it)")
        if file.stat().st_size < size:
            raise CheckpointError(
                f"checkpoint {file}: truncated, {file.stat().st_size} bytes where {METADATA_FILE} needs {size}"
            )
    check_bytes(path, metadata, trust_checkpoint)
    return metadata


def check_matches(
    path: str | Path, metadata: Metadata, state: dict[str, Any], model_entries: Iterable[str] = ()
) -> None:
    """Every entry `state` (what `dcp.load` will fill) expects is in the checkpoint, tensors at the same full shape,
    and the checkpoint holds no model tensor that neither `state` nor `model_entries` (the names of `state["model"]`'s
    entries on the other pipeline stages) has."""
    expected, _ = flatten_state_dict(state)
    elsewhere = {f"model.{name}" for name in model_entries}
    saved = metadata.state_dict_metadata
    missing = [key for key in expected if key not in saved]
    if missing:
        more = f" (and {len(missing) - 1} more of this model's entries)" if len(missing) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path}: {missing[0]} is not there{more}; it was saved from another model or plan"
        )
    extra = [key for key in saved if key.startswith("model.") and key not in expected and key not in elsewhere]
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(
            f"checkpoint {path}: holds {extra[0]}{more}, which this model lacks; it was saved from another model"
        )
    for key, value in expected.items():
        if isinstance(value, torch.Tensor):
            entry = saved[key]
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"checkpoint {path}: {key} is not a tensor there but is one in this model")
            if tuple(entry.size) != tuple(value.shape):
                raise CheckpointError(
                    f"checkpoint {path}: {key} has shape {list(entry.size)} there but {list(value.shape)} in this model"
                )
