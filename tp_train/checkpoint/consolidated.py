"""A consolidated checkpoint: one file holding the full, unsharded state, in Lightning's own checkpoint layout.
Expert parallelism's experts are stored whole, stacked over all of them (gathered over rank 0's expert-parallel
group; each rank loads its run of them back)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from tp_train.checkpoint import on_disk
from tp_train.checkpoint.dcp import tensor_parallel_dim
from tp_train.checkpoint.safe_load import refusal, unsafe_globals
from tp_train.errors import CheckpointError
from tp_train.parallel.experts import ExpertParallelRegion, named_expert_parameters
from tp_train.parallel.sharding import ShardSpec, join_shards, local_part, named_sharded_parameters, shard_tensor

PARAMETER_NAMES = "tp_train_parameter_names"  # per optimizer: the name of each parameter index, to check on load


def check_data_parallel(save_distributed_checkpoint: bool, data_parallel: str) -> None:
    """A consolidated checkpoint gathers whole tensor-parallel shards, which sharded data parallelism splits."""
    if not save_distributed_checkpoint and data_parallel == "fsdp":
        raise ValueError(
            "save_distributed_checkpoint=False gathers whole tensor-parallel shards, which data_parallel='fsdp' "
            "splits further; use data_parallel='ddp', or save_distributed_checkpoint=True"
        )


def check_pipeline_parallel(save_distributed_checkpoint: bool, pipeline_parallel_size: int) -> None:
    """A consolidated checkpoint is written by global rank 0, which holds only the first pipeline stage."""
    if not save_distributed_checkpoint and pipeline_parallel_size > 1:
        raise ValueError(
            f"save_distributed_checkpoint=False writes one file from rank 0, which holds only the first of "
            f"pipeline_parallel_size={pipeline_parallel_size} stages; use save_distributed_checkpoint=True and "
            f"tp-train-export (one file with every stage) after training"
        )


def save(path: str | Path, model: nn.Module, optimizers: list, mesh: DeviceMesh, extra: dict) -> None:
    """Writes `extra` (Lightning's checkpoint dict) with the full `state_dict` and `optimizer_states` to the file
    `path`, from global rank 0 (see the module docstring); every rank calls it."""
    path = Path(path)
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model, buffers=True)}
    experts = {id(param): region for _, param, region in named_expert_parameters(model)}
    group, first_replica = _tensor_parallel_group(mesh)
    writer = dist.get_rank() == 0
    state = {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in experts:
            state[name] = _gathered_experts(value, experts[id(value)], writer)
        else:
            state[name] = _gathered(value, specs.get(id(value)), group, first_replica, writer)
    names = {id(param): name for name, param in model.named_parameters()}
    optimizer_states, parameter_names = [], []
    for optimizer in optimizers:
        full: dict[int, dict[str, Any]] = {}
        ordered = [param for group_ in optimizer.param_groups for param in group_["params"]]
        for index, param in enumerate(ordered):
            entries = optimizer.state.get(param, {})
            spec, region = specs.get(id(param)), experts.get(id(param))
            full[index] = {
                key: _gathered_experts(value, region, writer)
                if region is not None and _shaped_like(value, param)
                else _gathered(value, spec if _shaped_like(value, param) else None, group, first_replica, writer)
                for key, value in entries.items()
            }
        groups, start = [], 0
        for group_ in optimizer.param_groups:
            count = len(group_["params"])
            groups.append(
                {**{k: v for k, v in group_.items() if k != "params"}, "params": list(range(start, start + count))}
            )
            start += count
        optimizer_states.append({"state": {i: s for i, s in full.items() if s}, "param_groups": groups})
        parameter_names.append([names[id(param)] for param in ordered])
    if writer:
        unsafe = unsafe_globals({k: v for k, v in extra.items() if k not in ("state_dict", "optimizer_states")})
        if unsafe:
            raise ValueError(f"checkpoint metadata holds {', '.join(unsafe)}, which a checkpoint cannot hold as data")
        checkpoint = {
            **extra,
            "state_dict": state,
            "optimizer_states": optimizer_states,
            PARAMETER_NAMES: parameter_names,
        }
        on_disk.check_free_space(path, on_disk.checkpoint_bytes(checkpoint))
        tmp = path.with_name(path.name + on_disk.INCOMPLETE)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            torch.save(checkpoint, tmp)
            os.replace(tmp, path)
        except OSError as error:
            tmp.unlink(missing_ok=True)
            if on_disk.is_disk_full(error):
                raise on_disk.disk_full_error(path, on_disk.checkpoint_bytes(checkpoint), None) from None
            raise
    dist.barrier()


def load(
    path: str | Path, model: nn.Module, optimizers: list, mesh: DeviceMesh, trust_checkpoint: bool = False
) -> dict:
    """Loads the file `path` (written by `save`, or by plain Lightning) into the sharded `model` and `optimizers`,
    at any tp; returns the rest of the checkpoint (Lightning's loops, callbacks, schedulers)."""
    path = Path(path)
    checkpoint = read(path, trust_checkpoint)
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model, buffers=True)}
    experts = {id(param): region for _, param, region in named_expert_parameters(model)}
    tp_group, _ = _tensor_parallel_group(mesh)
    rank, tp = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    state = checkpoint["state_dict"]
    live = model.state_dict(keep_vars=True)
    missing = sorted(set(live) - set(state))
    if missing:
        raise CheckpointError(f"checkpoint {path}: {missing[0]} is not there; it was saved from another model")
    with torch.no_grad():
        for name, value in live.items():
            if isinstance(value, torch.Tensor):
                full = _own_experts(state[name], experts.get(id(value)))
                _copy_shard(value, full, specs.get(id(value)), rank, tp, path, name)
    extras = {k: v for k, v in state.items() if k in live and not isinstance(live[k], torch.Tensor)}
    if extras:
        model.load_state_dict(extras, strict=False)
    names = dict(model.named_parameters())
    saved_names = checkpoint.get(PARAMETER_NAMES)
    for index, (optimizer, saved) in enumerate(zip(optimizers, checkpoint.get("optimizer_states", []), strict=False)):
        ordered = [param for group in optimizer.param_groups for param in group["params"]]
        if saved_names is not None:
            expected = [names[n] for n in saved_names[index]]
            if [id(p) for p in expected] != [id(p) for p in ordered]:
                raise CheckpointError(f"checkpoint {path}: optimizer {index} updates other parameters than this one")
        with torch.no_grad():
            for param_index, param in enumerate(ordered):
                entries = saved["state"].get(param_index, {})
                spec, region = specs.get(id(param)), experts.get(id(param))
                optimizer.state[param] = {
                    key: _shard_like(_own_experts(value, region), param, spec, rank, tp)
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in entries.items()
                }
        for group, loaded in zip(optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({key: value for key, value in loaded.items() if key != "params"})
    return {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states", PARAMETER_NAMES)}


def read(path: Path, trust_checkpoint: bool = False) -> dict:
    """The checkpoint dict in the file `path`, read as data (memory-mapped: each rank pages in what it copies)."""
    try:
        unsafe = [] if trust_checkpoint else torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except Exception as error:  # noqa: BLE001 - not a torch.save file at all
        raise CheckpointError(
            f"checkpoint {path}: a file, not a checkpoint directory nor a Lightning checkpoint file "
            f"({type(error).__name__})"
        ) from None
    if unsafe:
        raise refusal(path, f"it names {', '.join(unsafe)}")
    try:
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=not trust_checkpoint)
    except Exception as error:  # noqa: BLE001 - whatever a damaged file raises
        raise CheckpointError(f"checkpoint {path}: unreadable, {type(error).__name__}") from None
    if not isinstance(checkpoint, dict) or "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {path}: a file without a state_dict, not a Lightning checkpoint")
    return checkpoint


def _tensor_parallel_group(mesh: DeviceMesh) -> tuple[dist.ProcessGroup, bool]:
    """The tensor-parallel group of this rank, and whether it is the first data-parallel replica's (the one that
    gathers for the writer)."""
    tp_dim = tensor_parallel_dim(mesh)
    first = all(c == 0 for dim, c in enumerate(mesh.get_coordinate()) if dim != tp_dim)
    return mesh.get_group(tp_dim), first


def _shaped_like(value: Any, param: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == param.shape


def _gathered(value: Any, spec: ShardSpec | None, group, first_replica: bool, writer: bool) -> Any:
    """The full tensor of `value` on the writer, in the source module's layout, on the host; None elsewhere (plain
    values are returned as they are). A collective over `group` for a shard, by the first replica only."""
    if not isinstance(value, torch.Tensor):
        return value
    local = local_part(value).detach()
    if spec is None:
        return local.to("cpu", copy=True) if writer else None
    if not first_replica:
        return None
    destination = dist.get_global_rank(group, 0)
    shards = [torch.empty_like(local) for _ in range(dist.get_world_size(group))] if writer else None
    dist.gather(local.contiguous(), shards, dst=destination, group=group)
    if not writer:
        return None
    full = join_shards(shards, spec)
    return (full.t() if spec.transposed else full).to("cpu", copy=True).contiguous()


def _gathered_experts(value: torch.Tensor, region: ExpertParallelRegion, writer: bool) -> torch.Tensor | None:
    """All the experts of `value` (this rank's run of them, stacked along dim 0) on the writer, on the host; None
    elsewhere. A collective over the expert-parallel group holding global rank 0 (its other groups hold copies)."""
    if 0 not in dist.get_process_group_ranks(region.group):
        return None
    local = local_part(value).detach().contiguous()
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(region.group))] if writer else None
    dist.gather(local, pieces, dst=0, group=region.group)
    return torch.cat(pieces).to("cpu", copy=True) if writer else None


def _own_experts(full: torch.Tensor, region: ExpertParallelRegion | None) -> torch.Tensor:
    """This rank's run of the experts in `full` (all of them stacked along dim 0), or `full` as it is."""
    if region is None or full.dim() == 0 or full.shape[0] != region.num_experts:
        return full
    return full.narrow(0, region.first, region.local)


def _shard_like(full: torch.Tensor, param: torch.Tensor, spec: ShardSpec | None, rank: int, tp: int) -> torch.Tensor:
    """This rank's part of an optimizer state tensor: sharded like `param` if it is the full parameter's shape."""
    local = full.t() if spec is not None and spec.transposed and full.dim() == 2 else full
    if spec is None or local.dim() != param.dim() or local.size(spec.dim) != sum(spec.sections):
        return full.to(param.device, copy=True)
    return shard_tensor(local, spec, rank, tp).to(param.device)


def _copy_shard(target: torch.Tensor, full: torch.Tensor, spec, rank: int, tp: int, path: Path, name: str) -> None:
    target = local_part(target)
    piece = full if spec is None else shard_tensor(full.t() if spec.transposed else full, spec, rank, tp)
    if piece.shape != target.shape:
        raise CheckpointError(
            f"checkpoint {path}: {name} has shape {list(full.shape)} there, which does not fit this model's "
            f"{list(target.shape)} shard"
        )
    target.copy_(piece)
