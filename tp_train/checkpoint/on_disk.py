"""What a checkpoint directory holds on disk: which checkpoints are complete, and whether the next one fits."""

from __future__ import annotations

import errno
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from tp_train.errors import DiskFullError

METADATA_FILE = ".metadata"  # DCP's index, written last
INCOMPLETE = ".tmp"  # a save in progress, or one that was killed or ran out of disk
ITEM_BYTES = 2 << 10  # DCP's framing of each stored piece of a tensor (measured: 1.5 KiB with torch 2.13)
OVERHEAD_BYTES = 256 << 10  # DCP's index, Lightning's metadata (meta.pt), filesystem blocks: beside 1% of the tensors


def is_complete(path: Path) -> bool:
    """A checkpoint whose save completed (see the module docstring); never a `*.tmp`."""
    if path.name.endswith(INCOMPLETE):
        return False
    if path.is_dir():
        return (path / METADATA_FILE).is_file()
    return path.is_file() and path.suffix == ".ckpt"


def saved_at(checkpoint: Path) -> float:
    """When a complete checkpoint's save finished (its last file's modification time)."""
    if checkpoint.is_file():
        return checkpoint.stat().st_mtime
    files = [checkpoint / name for name in ("meta.pt", METADATA_FILE)]
    return max(f.stat().st_mtime for f in files if f.is_file())


def newest_complete(directory: Path, prefer: str = "last.ckpt") -> Path | None:
    """The newest complete checkpoint in `directory`, or None; of checkpoints saved at the same moment (a link and
    what it names), the one called `prefer`."""
    found = [path for path in sorted(directory.glob("*")) if is_complete(path)]
    return max(found, key=lambda path: (saved_at(path), path.name == prefer), default=None)


def checkpoint_bytes(state: Any) -> int:
    """Bytes the tensors of `state` (a nested checkpoint state) take on disk: a DTensor at its full size, once,
    whichever ranks hold its pieces; a plain tensor once (DCP stores one copy of a replicated tensor)."""
    if isinstance(state, DTensor):  # numel of the global shape, in one stored piece per shard
        pieces = math.prod(state.device_mesh.size(i) for i, p in enumerate(state.placements) if p.is_shard())
        return state.numel() * state.element_size() + pieces * ITEM_BYTES
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size() + ITEM_BYTES
    if isinstance(state, dict):
        return sum(checkpoint_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(checkpoint_bytes(value) for value in state)
    return 0


def free_bytes(directory: Path) -> int:
    """Free bytes of the filesystem `directory` is (or will be) on, for an unprivileged writer."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def check_free_space(path: Path, needed: int) -> None:
    """Raises `DiskFullError` (one line) when a checkpoint of `needed` bytes does not fit beside what is there."""
    free, needed = free_bytes(path.parent), needed + needed // 100 + OVERHEAD_BYTES
    if needed > free:
        raise disk_full_error(path, needed, free, before=True)


def disk_full_error(path: Path, needed: int | None, free: int | None, before: bool = False) -> DiskFullError:
    """The one line for a checkpoint at `path` that does not fit: the directory, bytes needed and free, and the
    checkpoint that stays valid."""
    directory = path.parent
    free = free_bytes(directory) if free is None else free
    kept = newest_complete(directory)
    kept = kept.resolve() if kept is not None else None  # the checkpoint a `last.ckpt` link names
    valid = (
        f"{kept.name} there stays the last complete checkpoint (rerun the same command with more space to resume "
        f"from it)"
        if kept is not None
        else "no checkpoint of this run is complete yet"
    )
    needs = f"needs {needed:,} bytes" if needed is not None else "ran out of space"
    what = "not saved" if before else "not saved, the disk filled up while it was written"
    return DiskFullError(f"checkpoint {path.name} {what}: it {needs} and {directory} has {free:,} bytes free; {valid}")


def is_disk_full(error: BaseException) -> bool:
    """True for an error (or one DCP gathered from any rank, or one it was raised from) that says the disk is full."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint's CheckpointException
        for failure in (failures or {}).values():
            pending.append(failure[0] if isinstance(failure, tuple) else failure)
        pending += [current.__cause__, current.__context__]
    return "No space left on device" in str(error)


def remove(path: Path) -> None:
    """Removes a checkpoint (a directory, a file or a link; a link, not what it names), if there."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
