"""Sharded data parallelism over a tensor-parallel model: torch's FSDP2 (`fully_shard`) on the data-parallel axis,
one group per block, one per model for the rest, and the root (docs/cluster.md)."""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard

from tp_train.parallel.sharding import data_parallel_shard_dim, named_sharded_parameters
from tp_train.plan.gradient_hooks import keep_gradient_hooks


def refuse_replicated_shards(root: nn.Module, tensor_parallel_size: int) -> None:
    """FSDP2 cannot shard a parameter that several tensor-parallel ranks hold the same piece of (replicated kv
    heads, tp > kv heads): one line naming it."""
    for name, _, spec in named_sharded_parameters(root):
        copies = max(spec.replicas(tensor_parallel_size))
        if copies > 1:
            raise ValueError(
                f"'{name}' holds kv heads replicated over {copies} tensor-parallel ranks, which "
                f"data_parallel='fsdp' does not support yet; use data_parallel='ddp', or tp at most the kv-head count"
            )


def fully_shard_data_parallel(
    root: nn.Module,
    models: Iterable[nn.Module],
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    extra_methods: Iterable[str] = (),
    ignored_params: set[nn.Parameter] | None = None,
) -> list[FSDPModule]:
    """Shards the parameters of `root` over the data-parallel `mesh` with FSDP2, bottom-up (each of `models`'
    blocks, then each model, then `root`; `extra_methods` gather the parameters too); returns every FSDP module, root
    last. `ignored_params` stay as they are, neither sharded nor their gradients reduced (an expert-parallel rank's
    experts, which its replicas do not share with the other ranks).

    A 1-D `mesh` splits each tensor-parallel shard over all of its ranks (FSDP); a 2-D (replicate, shard) mesh splits
    it over the shard axis and replicates that over the other (HSDP): each gradient is reduce-scattered within a
    shard group, then all-reduced across the groups, averaged over every rank of the mesh either way."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard_data_parallel needs a 1-D data-parallel mesh, or a 2-D (replicate, shard) one, got "
            f"{mesh.mesh_dim_names}"
        )
    models = list(models)
    specs = {id(param): spec for model in models for _, param, spec in named_sharded_parameters(model)}
    shards = mesh.size(mesh.ndim - 1)  # the ranks each parameter is split over: the shard axis, innermost

    def placement(param: nn.Parameter) -> Shard:
        return Shard(data_parallel_shard_dim(tuple(param.shape), specs.get(id(param)), shards))

    options = dict(
        mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy or MixedPrecisionPolicy(),
        ignored_params=ignored_params or None,
    )  # fmt: skip
    # A pipeline stage holds some of the blocks only (tp_train.parallel.pipeline.stage): those it holds
    names = [(model, name) for model in models for name in getattr(model, "tp_blocks", [])]
    blocks = [model.get_submodule(name) for model, name in names if _holds(model, name)]
    wrapped = [fully_shard(block, **options) for block in blocks]
    wrapped.extend(fully_shard(model, **options) for model in models if model is not root)
    wrapped.append(fully_shard(root, **options))
    keep_gradient_hooks(root)  # tensor parallelism's gradient all-reduces, on FSDP2's unsharded parameters
    for method in extra_methods:
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)
    return wrapped


def _holds(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True
