"""Sharded checkpoints of a tensor-parallel model and its optimizers, with torch.distributed.checkpoint (DCP)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tp_train.checkpoint import on_disk, stages
from tp_train.checkpoint.async_writer import AsyncCheckpointWriter
from tp_train.checkpoint.checks import check_files, check_matches
from tp_train.checkpoint.safe_load import SafeFileSystemReader, SafeLoadPlanner, read_extra, unsafe_globals
from tp_train.errors import CheckpointError
from tp_train.parallel.experts import ExpertParallelRegion, named_expert_parameters
from tp_train.parallel.mesh import TENSOR_PARALLEL, first_rank_decides  # TENSOR_PARALLEL: the axis a 2-D mesh shards
from tp_train.parallel.sharding import (
    ShardSpec,
    data_parallel_split,
    fill_replicas,
    local_part,
    named_sharded_parameters,
)

META_FILE = "meta.pt"  # the caller's `extra` metadata, beside DCP's files
HUGGING_FACE_CONFIG_KEY = "hugging_face_config"  # a checkpoint's copy of its Hugging Face model's config
ADAPTER_CONFIG_KEY = "adapter_config"  # the peft config of a model trained with adapters, as plain data
TOKENIZER_KEY = "tokenizer"  # where the tokenizer the run used is (a path)
BASE_WEIGHTS_KEY = "base_weights"  # the pretrained weights a checkpoint of adapters was trained on, not held in it
LAYOUT_KEY = "tp_train_layout"  # {state name: [dim of its sections, stored transposed]} of each sharded tensor


def model_state_dict(model: nn.Module, mesh: DeviceMesh, write_backs: list | None = None) -> dict[str, Any]:
    """The model's state for `dcp.save` / `dcp.load`: its `state_dict` keys (a tied parameter under each name),
    sharded tensors as DTensor views of the live parameters, so that loading writes into the parameters.

    Args:
        model: a model sharded by `tp_train.plan.parallelize`.
        mesh: the tensor-parallel mesh (1-D), or a 2-D mesh with a "tensor_parallel" dimension.
        write_backs: where to collect the copies made of FSDP2-sharded tensors (see the module docstring), to be
            written back into the parameters with `write_back` once DCP has loaded into them.
    """
    _check_mesh(model, mesh)
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model, buffers=True)}  # persistent ones
    experts = {id(param): region for _, param, region in named_expert_parameters(model)}
    from_base, _ = base_weights(model)
    state: dict[str, Any] = {}
    for name, value in model.state_dict(keep_vars=True).items():  # keep_vars: the parameters themselves
        if id(value) in from_base:
            continue
        if id(value) in experts:
            state[name] = _expert_dtensor(value.detach(), experts[id(value)])
        elif id(value) in specs:
            state.update(_as_dtensors(name, value.detach(), specs[id(value)], mesh, write_backs))
        else:
            state[name] = value.detach() if isinstance(value, torch.Tensor) else value
    return state


def load_model_state_dict(model: nn.Module, mesh: DeviceMesh, state: dict[str, Any]) -> None:
    """Finishes loading `state`, a `model_state_dict` that `dcp.load` filled: views of the parameters are loaded
    already, other tensors are copied in, non-tensor extra state goes through `load_state_dict`, and the
    vocabulary padding rows are zeroed."""
    live = model_state_dict(model, mesh)
    with torch.no_grad():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                _copy_into(live[key], value)
        tp_dim = tensor_parallel_dim(mesh)
        rank, tp = mesh.get_local_rank(tp_dim), mesh.size(tp_dim)
        for _, param, spec in named_sharded_parameters(model):
            local = local_part(param)
            if spec.padded and local.size(spec.dim) == sum(spec.local_sections(tp)):  # all of its tp shard's rows
                rows = spec.slices(rank, tp)[0]
                local.narrow(spec.dim, rows.real, rows.local - rows.real).zero_()
            if not isinstance(param, DTensor):  # FSDP2 with replicated kv heads is refused before it gets here
                fill_replicas(param, spec, mesh.get_group(tp_dim))
    extra = {key: value for key, value in state.items() if not isinstance(value, torch.Tensor)}
    if extra:
        model.load_state_dict(extra, strict=False)


def optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, write_backs: list | None = None
) -> dict[str, Any]:
    """The optimizer's state for DCP: `{"state": {param name: {key: value}}, "param_groups": [...]}`, each
    parameter under its name in the whole model and each group's `params` naming those of every pipeline stage
    (`tp_train.checkpoint.stages`), so that the state reshards across pp by name.

    Args:
        model: the parallelized model whose parameters `optimizer` updates.
        optimizer: a `torch.optim.Optimizer` (not Lightning's `LightningOptimizer` wrapper).
        mesh: as for `model_state_dict`.
        write_backs: as for `model_state_dict`.
    """
    _check_mesh(model, mesh)
    _create_missing_state(optimizer)
    names = stages.parameter_names(model)
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model)}
    experts = {id(param): region for _, param, region in named_expert_parameters(model)}
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError(f"the optimizer updates a parameter {tuple(param.shape)} that is not the model's")
            entries: dict[str, Any] = {}
            spec, region = specs.get(id(param)), experts.get(id(param))
            for key, value in optimizer.state.get(param, {}).items():
                if region is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                    entries[key] = _expert_dtensor(value, region)
                elif spec is not None and isinstance(value, torch.Tensor) and value.shape == param.shape:
                    entries.update(_as_dtensors(key, value, spec, mesh, write_backs))
                else:
                    entries[key] = value
            state[names[id(param)]] = entries
        hyperparameters = {key: value for key, value in group.items() if key != "params"}
        held = [names[id(param)] for param in group["params"]]
        param_groups.append({**hyperparameters, "params": stages.across_stages(held, mesh)})
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, mesh: DeviceMesh, state: dict[str, Any]
) -> None:
    """Puts `state` (an `optimizer_state_dict` that `dcp.load` filled) into `optimizer`: tensors are copied in
    unless they already are the optimizer's, other values and the group hyperparameters are set."""
    live = optimizer_state_dict(model, optimizer, mesh)
    if [set(group["params"]) for group in state["param_groups"]] != [set(g["params"]) for g in live["param_groups"]]:
        raise ValueError("the checkpoint's optimizer parameter groups name other parameters than this optimizer's")
    names = stages.parameter_names(model)
    params = {names[id(param)]: param for param in model.parameters()}
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model)}
    with torch.no_grad():
        for name, entries in state["state"].items():
            for key, value in entries.items():
                target = live["state"][name].get(key)
                if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
                    _copy_into(target, value)
                else:
                    optimizer.state[params[name]][key] = value
            spec = specs.get(id(params[name]))
            for value in optimizer.state[params[name]].values() if spec is not None else ():
                if isinstance(value, torch.Tensor) and value.shape == params[name].shape:
                    fill_replicas(value, spec, mesh.get_group(tensor_parallel_dim(mesh)))
    for group, loaded in zip(optimizer.param_groups, state["param_groups"], strict=True):
        group.update({key: value for key, value in loaded.items() if key != "params"})


def save(
    path: str | Path,
    model: nn.Module,
    optimizers: list,
    mesh: DeviceMesh,
    extra: dict | None = None,
    writer: AsyncCheckpointWriter | None = None,
) -> None:
    """Saves a sharded checkpoint directory at `path`; a collective, every rank writes its own shards.

    Args:
        path: the checkpoint directory.
        model: the parallelized model.
        optimizers: its optimizers, stored as `optimizer_0`, `optimizer_1`, ...
        mesh: as for `model_state_dict`.
        extra: metadata (e.g. Lightning's loop state) of plain data (dicts, lists, tuples, strings, numbers,
            tensors, numpy arrays), written by rank 0 with `torch.save` to `path/meta.pt` and returned by `load`,
            which reads it with `torch.load(weights_only=True)`.
        writer: write in the background (`AsyncCheckpointWriter`): this call returns once the state is staged.
    """
    extra = dict(extra) if extra is not None else {}
    _, base = base_weights(model)
    if base is not None:  # its frozen pretrained parameters are not saved: where they come from is
        extra[BASE_WEIGHTS_KEY] = base
    # How each sharded tensor is stored, so that one process can rebuild the model's own state (tp-train-export).
    extra[LAYOUT_KEY] = {name: [spec.dim, spec.transposed] for name, _, spec in named_sharded_parameters(model, True)}
    unsafe = unsafe_globals(extra) if dist.get_rank() == 0 else []
    if unsafe:
        key = next(key for key, value in extra.items() if unsafe_globals({key: value}))
        raise ValueError(
            f"checkpoint metadata '{key}' holds {', '.join(unsafe)}, which a checkpoint cannot hold as data; store "
            f"plain dicts, lists, numbers, strings and tensors (e.g. a callback's state_dict)"
        )
    state = _checkpoint_state(model, optimizers, mesh)
    _check_free_space(Path(path), state)
    if writer is None:
        write(state, Path(path), extra)
    else:
        writer.submit(write, state, Path(path), extra)


def write(state: dict[str, Any], path: Path, extra: dict, group: dist.ProcessGroup | None = None) -> None:
    """Writes `state` (a `_checkpoint_state`, or DCP's staged copy of one) and `extra` as the checkpoint `path`
    (see `save`), synchronising over `group` (default: the world)."""
    tmp, old, is_writer = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old"), dist.get_rank() == 0
    if is_writer and tmp.exists():
        shutil.rmtree(tmp)  # left by a save that was killed
    dist.barrier(group)
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
        if is_writer:
            torch.save(extra, tmp / META_FILE)
    except Exception as error:
        if not on_disk.is_disk_full(error):
            raise
        if is_writer:  # DCP gathered the failure on every rank: each raises the same line, rank 0 cleans up
            shutil.rmtree(tmp, ignore_errors=True)
        raise on_disk.disk_full_error(path, on_disk.checkpoint_bytes(state), None) from None
    dist.barrier(group)
    if is_writer:
        on_disk.remove(old)
        if path.exists() or path.is_symlink():  # a link (ModelCheckpoint's last.ckpt) is replaced, not followed
            path.rename(old)
        tmp.rename(path)
        on_disk.remove(old)
    dist.barrier(group)


def load(
    path: str | Path, model: nn.Module, optimizers: list, mesh: DeviceMesh, trust_checkpoint: bool = False
) -> dict:
    """Loads a checkpoint written by `save` into `model` and `optimizers` in place, at any tp; returns `extra`."""
    path = Path(path)
    metadata = check_files(path, trust_checkpoint)
    extra = checkpoint_extra(path, trust_checkpoint)  # before any tensor is copied: a bad meta.pt changes nothing
    extra.pop(LAYOUT_KEY, None)  # ours, for tp-train-export; the model at hand knows its layout
    _, base = base_weights(model)
    if extra.get(BASE_WEIGHTS_KEY) != base and (base is not None or BASE_WEIGHTS_KEY in extra):
        saved = extra.get(BASE_WEIGHTS_KEY)
        raise CheckpointError(
            f"checkpoint {path}: holds adapters trained on the pretrained weights {saved}, and this model's frozen "
            f"weights come from {base}; build the model from {saved}"
            if saved is not None
            else f"checkpoint {path}: holds a whole model, and this one's frozen weights come from {base}; load it "
            f"into a model built without pretrained weights"
        )
    write_backs: list = []
    state = _checkpoint_state(model, optimizers, mesh, write_backs)
    # the model's entries that any pipeline stage loads: the checkpoint may hold no other
    check_matches(path, metadata, state, stages.across_stages(state["model"], mesh))
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(path, trust_checkpoint),
            planner=SafeLoadPlanner(trust_checkpoint),
        )
    except CheckpointException as error:  # DCP gathers every rank's failure into a multi-line report
        failure = next(iter(error.failures.values()), (error,))  # rank -> (exception, traceback)
        failure = failure[0] if isinstance(failure, tuple) else failure
        raise CheckpointError(
            f"checkpoint {path}: unreadable, reading its tensors failed with {type(failure).__name__} (corrupt shards)"
        ) from error
    with torch.no_grad():
        for copy_back in write_backs:
            copy_back()
    load_model_state_dict(model, mesh, state["model"])
    for index, optimizer in enumerate(optimizers):
        load_optimizer_state_dict(model, optimizer, mesh, state[f"optimizer_{index}"])
    return extra


def _check_free_space(path: Path, state: dict[str, Any]) -> None:
    """Refuses the save, on every rank alike and before anything is written, when the checkpoint does not fit on
    its filesystem as rank 0 sees it (`tp_train.checkpoint.on_disk`)."""

    def check() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)  # now: a link to the checkpoint may be made before it is written
        on_disk.check_free_space(path, on_disk.checkpoint_bytes(state))

    first_rank_decides(check)


def checkpoint_extra(path: Path, trust_checkpoint: bool = False) -> dict:
    """The `extra` metadata `save` wrote to `path/meta.pt` ({} when there is none), read as data."""
    return read_extra(path / META_FILE, trust_checkpoint) if (path / META_FILE).exists() else {}


def base_weights(model: nn.Module) -> tuple[set[int], str | None]:
    """The frozen parameters of `model` that come from pretrained weights (a module's `pretrained_weights`, loaded
    whenever the model is built: `tp_train.checkpoint.pretrained`), by id, and that path: a checkpoint of adapters
    trained on them holds the adapters and refers to the path instead (none when nothing is frozen)."""
    found, path = set(), None
    for module in model.modules():
        if getattr(module, "pretrained_weights", None):
            frozen = {id(param) for param in module.parameters() if not param.requires_grad}
            found |= frozen
            path = path or (str(module.pretrained_weights) if frozen else None)
    return found, path


def _checkpoint_state(
    model: nn.Module, optimizers: list, mesh: DeviceMesh, write_backs: list | None = None
) -> dict[str, Any]:
    optimizer_states = {
        f"optimizer_{i}": optimizer_state_dict(model, opt, mesh, write_backs) for i, opt in enumerate(optimizers)
    }
    return {"model": model_state_dict(model, mesh, write_backs), **optimizer_states}


def tensor_parallel_dim(mesh: DeviceMesh) -> int:
    """The mesh's tensor-parallel dimension: its only one, or the one named "tensor_parallel"."""
    if mesh.ndim == 1:
        return 0
    if TENSOR_PARALLEL not in (mesh.mesh_dim_names or ()):
        raise ValueError(f"a {mesh.ndim}-D mesh needs a '{TENSOR_PARALLEL}' dimension, got {mesh.mesh_dim_names}")
    return mesh.mesh_dim_names.index(TENSOR_PARALLEL)


def _check_mesh(model: nn.Module, mesh: DeviceMesh) -> None:
    """The mesh's tensor-parallel dimension must be the group the model was sharded over."""
    mesh_ranks = dist.get_process_group_ranks(mesh.get_group(tensor_parallel_dim(mesh)))
    for module in model.modules():
        group = getattr(module, "group", None) if getattr(module, "shard_specs", None) else None
        if group is not None and (ranks := dist.get_process_group_ranks(group)) != mesh_ranks:
            raise ValueError(f"the model is sharded over ranks {ranks}, the mesh's tensor-parallel dim is {mesh_ranks}")


def _as_dtensors(
    key: str, shard: torch.Tensor, spec: ShardSpec, mesh: DeviceMesh, write_backs: list | None = None
) -> dict[str, DTensor]:
    """One DTensor per section of `shard` (this rank's tensor-parallel shard, or FSDP2's DTensor of it), each a view
    holding only real data: of the shard, of FSDP2's piece of it, or of a gathered copy (see the module docstring;
    a callable that writes the copy back into the piece is appended to `write_backs`)."""
    mesh = stages.stage_mesh(mesh)  # FSDP2's Shard goes on the data-parallel dimensions, never on the pipeline's
    tp_dim = tensor_parallel_dim(mesh)
    tp, rank = mesh.size(tp_dim), mesh.get_local_rank(tp_dim)
    slices = spec.slices(rank, tp)
    local, data_parallel, copies_over = shard, Replicate(), ()
    if isinstance(shard, DTensor):  # FSDP2: a DTensor over the data-parallel mesh
        split, placement = data_parallel_split(shard)
        # HSDP: whole copies along its replicate axis, which the job's mesh names alike
        named = zip(shard.device_mesh.mesh_dim_names or (), shard.placements, strict=False)
        copies_over = [name for name, kind in named if kind.is_replicate()]
        if placement.dim != spec.dim:
            local, data_parallel = shard.to_local(), placement
        else:
            local = shard.full_tensor()
            if write_backs is not None:
                write_backs.append(lambda: _write_back(shard, local, split, placement.dim))
    if local.size(spec.dim) != sum(rows.local for rows in slices):
        raise ValueError(f"'{key}' has {local.size(spec.dim)} rows along dim {spec.dim}, not a shard for tp={tp}")
    placements = [
        Shard(spec.dim) if dim == tp_dim else Replicate() if name in copies_over else data_parallel
        for dim, name in enumerate(mesh.mesh_dim_names or [None] * mesh.ndim)
    ]
    pieces, offset = {}, 0
    for index, (full_size, rows, copies) in enumerate(zip(spec.sections, slices, spec.replicas(tp), strict=True)):
        piece = local.narrow(spec.dim, offset, rows.real)
        if copies > 1:  # a replicated kv head: each replica stores its 1/copies of it, so it is stored once
            piece = piece.narrow(spec.dim, rank % copies * (rows.real // copies), rows.real // copies)
        offset += rows.local
        shape = shard.shape[: spec.dim] + (full_size,) + shard.shape[spec.dim + 1 :]
        stride = torch.empty(shape, device="meta").stride()
        name = key if len(spec.sections) == 1 else f"{key}/section{index}"
        pieces[name] = DTensor.from_local(piece, mesh, placements, run_check=False, shape=shape, stride=stride)
    return pieces


def _expert_dtensor(local: torch.Tensor, region: ExpertParallelRegion) -> DTensor:
    """This rank's run of experts (a view of `local`, stacked along dim 0) as a DTensor of all the experts, split
    over the expert-parallel group: saved by expert index, so a checkpoint loads at any expert-parallel size."""
    mesh = DeviceMesh.from_group(region.group, local.device.type)
    shape = (region.num_experts, *local.shape[1:])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=shape, stride=stride)


def _write_back(shard: DTensor, gathered: torch.Tensor, split: int, dim: int) -> None:
    """Copies this rank's chunk of `gathered` (FSDP2's torch.chunk split over mesh dimension `split`, empty past the
    last chunk) into `shard`."""
    local = shard.to_local()
    chunks = gathered.chunk(shard.device_mesh.size(split), dim=dim)
    rank = shard.device_mesh.get_local_rank(split)
    if rank < len(chunks) and local.numel():
        local.copy_(chunks[rank])


def _copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    target, source = (t.to_local() if isinstance(t, DTensor) else t for t in (target, source))
    if target.data_ptr() != source.data_ptr() or target.stride() != source.stride():  # not a view of the target
        target.copy_(source)


def _create_missing_state(optimizer: torch.optim.Optimizer) -> None:
    """Creates the state of parameters that have none by one step with zero gradients, learning rate and weight
    decay, then resets their `step` counters to 0. For Adam, AdamW, SGD (undampened), RMSprop and Adagrad that
    state behaves exactly as absent state (torch's own `_init_optim_state` leaves step 1, which changes Adam's
    bias correction). Gradients, hyperparameters and the other parameters' state are left as they were."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    missing = {id(param): param for param in params if param.requires_grad and not optimizer.state.get(param)}
    if not missing:
        return
    grads = [param.grad for param in params]
    groups = [dict(group) for group in optimizer.param_groups]  # to restore the hyperparameters
    try:
        for param in params:
            param.grad = torch.zeros_like(param) if id(param) in missing else None
        for group in optimizer.param_groups:
            group.update({key: group[key] * 0 for key in ("lr", "weight_decay") if key in group})  # float or tensor
        optimizer.step()
    finally:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        for group, saved in zip(optimizer.param_groups, groups, strict=True):
            group.update(saved)
    for param in missing.values():
        state = optimizer.state.get(param, {})
        if "step" in state:
            state["step"] = state["step"] * 0
