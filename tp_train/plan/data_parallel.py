"""Sharded data parallelism over a tensor-parallel model: torch's FSDP2 (`fully_shard`) on the data-parallel axis.

After `parallelize` every parameter is a plain local tensor (Megatron-style: this rank's tensor-parallel shard, or
a whole replicated tensor), so FSDP2 sees ordinary parameters and shards each of them once more, over the
data-parallel ranks: each rank keeps 1/dp of its tensor-parallel shard, with its gradient and optimizer states, as
a DTensor on the 1-D data-parallel mesh. FSDP2 all-gathers a group's parameters before its forward (and again
before its backward) and reduce-scatters its gradients after the backward.

One group per transformer block (the blocks `parallelize` found from the plan, as sequence parallelism and
activation checkpointing do), one per planned model for what lies outside the blocks (embeddings, final norm,
head), and the root: the module whose methods (`extra_methods`) run the step.
"""

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
) -> list[FSDPModule]:
    """Shards the parameters of `root` over the 1-D data-parallel `mesh` with FSDP2, bottom-up; returns every
    FSDP module, root last.

    Args:
        root: the outermost module (e.g. the LightningModule); its own and all remaining parameters form the last
            group.
        models: the models inside `root` that `parallelize` sharded (`root` itself allowed); their blocks
            (`tp_blocks`) get a group each, then each model one for the rest of its parameters.
        mesh: the data-parallel mesh.
        mp_policy: FSDP2's mixed-precision policy (dtype of the gathered parameters and of the gradient reduction).
        extra_methods: methods of `root` besides `forward` that run the model (Lightning's `training_step`, ...),
            so that they, too, gather the parameters first.
    """
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard_data_parallel needs a 1-D data-parallel mesh, got {mesh.mesh_dim_names}")
    models = list(models)
    specs = {id(param): spec for model in models for _, param, spec in named_sharded_parameters(model)}
    dp = mesh.size()

    def placement(param: nn.Parameter) -> Shard:
        return Shard(data_parallel_shard_dim(tuple(param.shape), specs.get(id(param)), dp))

    options = dict(mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy or MixedPrecisionPolicy())
    wrapped = []
    for model in models:
        for name in getattr(model, "tp_blocks", []):
            wrapped.append(fully_shard(model.get_submodule(name), **options))
    wrapped.extend(fully_shard(model, **options) for model in models if model is not root)
    wrapped.append(fully_shard(root, **options))
    keep_gradient_hooks(root)  # tensor parallelism's gradient all-reduces, on FSDP2's unsharded parameters
    for method in extra_methods:
        if callable(getattr(root, method, None)):
            register_fsdp_forward_method(root, method)
    return wrapped
