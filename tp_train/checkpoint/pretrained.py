"""Pretrained weights from local safetensors files into a sharded model, each rank reading only its own slices."""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from torch.distributed import ProcessGroup

from tp_train.parallel.pipeline.split import skipped, within
from tp_train.parallel.sharding import ShardSpec, named_sharded_parameters

SINGLE_FILE = "model.safetensors"
BASE_LAYER = "base_layer"  # where a peft adapter layer keeps the layer it wraps
ADAPTER_MARK = ".lora_"  # in the names of a peft LoRA layer's own tensors (lora_A, lora_B, lora_embedding_A, ...)
INDEX_FILE = "model.safetensors.index.json"


def weight_files(path: str | Path) -> dict[str, Path]:
    """{tensor key: the safetensors file holding it} for a file, or a directory with a single file or an index."""
    path = Path(path).expanduser()
    if path.is_file():
        with safe_open(path, framework="pt") as handle:  # reads the header only
            return {key: path for key in handle.keys()}
    if (path / INDEX_FILE).is_file():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    if (path / SINGLE_FILE).is_file():
        return weight_files(path / SINGLE_FILE)
    pickled = sorted(p.name for p in path.glob("*.bin")) if path.is_dir() else []
    if pickled:
        raise FileNotFoundError(
            f"pretrained weights: {path} holds {pickled[0]}, pickled weights that could run code when read; tp_train "
            f"reads safetensors only: write them with save_pretrained (safetensors by default), or convert the file"
        )
    raise FileNotFoundError(
        f"pretrained weights: {path} is neither a .safetensors file nor a directory with {SINGLE_FILE} or "
        f"{INDEX_FILE}; use a directory written by save_pretrained"
    )


def load_pretrained(
    model: nn.Module, path: str | Path, group: ProcessGroup | None = None, skip: Collection[str] = ()
) -> int:
    """Fills `model`'s parameters and persistent buffers from the safetensors weights at `path`, in place, each
    rank reading only its shard of every sharded parameter. Works on an unsharded model too (tp = 1).

    Args:
        model: a model sharded by `tp_train.plan.parallelize` (or not sharded), its tensors materialised.
        path: a `.safetensors` file or a directory (see `weight_files`).
        group: the tensor-parallel group the model was sharded over (default: the whole world).
        skip: modules of `model` (by name) that other pipeline stages hold, left on the meta device: neither read
            nor required.

    Returns:
        The number of elements this rank read from the files.

    Raises:
        ValueError: a parameter the files do not hold, or a tensor whose shape is not the model's.
    """
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if dist.is_initialized() else (0, 1)
    files = weight_files(path)
    state = model.state_dict(keep_vars=True)  # keep_vars: the parameters themselves, a tied one under each name
    file_keys = _file_keys(model, state, files)
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model)}
    handles: dict[Path, object] = {}
    names: dict[int, list[str]] = {}  # a tied tensor's names: this rank holds it if it holds one of them
    for name, tensor in state.items():
        names.setdefault(id(tensor), []).append(name)
    held = {key for key, each in names.items() if not all(_skipped(name, skip) for name in each)}
    loaded, read = set(), 0
    for name, tensor in state.items():
        key = file_keys.get(name)
        if key is None or not isinstance(tensor, torch.Tensor) or id(tensor) in loaded or id(tensor) not in held:
            continue
        if files[key] not in handles:
            handles[files[key]] = safe_open(files[key], framework="pt")
        stored = handles[files[key]].get_slice(key)
        spec = specs.get(id(tensor))
        expected = _stored_shape(tensor, spec)
        if tuple(stored.get_shape()) != expected:
            raise ValueError(
                f"pretrained weights: '{key}' in {files[key].name} has shape {tuple(stored.get_shape())}, the "
                f"model's '{name}' needs {expected}; the directory holds another model's weights"
            )
        data = _read_shard(stored, spec, rank, world_size) if spec else stored[:]
        read += data.numel()
        with torch.no_grad():
            tensor.copy_(data)
        loaded.add(id(tensor))
    missing = [
        name
        for name, tensor in state.items()
        if isinstance(tensor, nn.Parameter)
        and id(tensor) not in loaded
        and ADAPTER_MARK not in name
        and id(tensor) in held
    ]
    if missing:
        raise ValueError(
            f"pretrained weights at {path} hold no tensor for {len(missing)} parameters of {type(model).__name__}, "
            f"e.g. {missing[:3]}; the files' keys look like {sorted(files)[:3]}"
        )
    return read


def load_pretrained_modules(
    model: nn.Module, group: ProcessGroup, weights: str | Path | None = None, skip: Collection[str] = ()
) -> None:
    """`weights` into `model`; without it, each submodule's own `pretrained_weights` (a path its factory recorded
    when it built the module empty, e.g. `models.hugging_face_causal_lm(path=...)` on the meta device) into it.
    The modules named in `skip` (other pipeline stages') are not read."""
    if weights is not None:
        load_pretrained(model, weights, group, skip)
        return
    for name, module in model.named_modules():
        if getattr(module, "pretrained_weights", None):
            load_pretrained(module, module.pretrained_weights, group, within(name, skip))


def _skipped(tensor_name: str, skip: Collection[str]) -> bool:
    """Whether the tensor `tensor_name` (a state-dict name) belongs to a module in `skip`."""
    return skipped(tensor_name.rpartition(".")[0], skip)


def _stored_shape(tensor: torch.Tensor, spec: ShardSpec | None) -> tuple[int, ...]:
    """The full tensor's shape as the file stores it (a Conv1D weight transposed)."""
    if spec is None:
        return tuple(tensor.shape)
    shape = list(tensor.shape)
    shape[spec.dim] = sum(spec.sections)
    return tuple(reversed(shape)) if spec.transposed else tuple(shape)


def _read_shard(stored, spec: ShardSpec, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard (in the parameter's layout), reading only its chunk of each section from the file."""
    file_dim = 1 - spec.dim if spec.transposed else spec.dim
    ndim = len(stored.get_shape())
    pieces = []
    for rows in spec.slices(rank, world_size):
        index = tuple(
            slice(rows.start, rows.start + rows.real) if dim == file_dim else slice(None) for dim in range(ndim)
        )
        piece = stored[index]
        piece = piece.t() if spec.transposed else piece
        if rows.real < rows.local:  # a padded vocabulary: the rows past the real ones are zero
            piece = F.pad(piece, [0, 0] * (piece.dim() - 1 - spec.dim) + [0, rows.local - rows.real])
        pieces.append(piece)
    return torch.cat(pieces, dim=spec.dim)


def _file_keys(model: nn.Module, state: dict, files: dict[str, Path]) -> dict[str, str]:
    """{model state name: file key}, through Hugging Face's key renamings and the base model prefix."""
    renamings = _hugging_face_renamings(model)
    prefix = getattr(model, "base_model_prefix", "")
    # An adapter layer's base: the file's `q_proj.weight` is the model's `q_proj.base_layer.weight`.
    adapted = {name.replace(f".{BASE_LAYER}.", "."): name for name in state if f".{BASE_LAYER}." in name}
    found = {}
    for key in files:
        name = key
        for renaming in renamings:
            name, _ = renaming.rename_source_key(name)
        if name not in state and name not in adapted and prefix:
            stripped = name.removeprefix(f"{prefix}.")
            name = stripped if stripped in state or stripped in adapted else f"{prefix}.{name}"
        name = adapted.get(name, name)
        if name in state:
            found[name] = key
    return found


def _hugging_face_renamings(model: nn.Module) -> list:
    """The plain key renamings transformers applies when loading this model's checkpoints (none for others)."""
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:  # another transformers version: exact names and the prefix only
        return []
    if not isinstance(model, PreTrainedModel):
        return []
    return [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
