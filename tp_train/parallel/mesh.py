"""The process groups tensor parallelism runs on: the names of the mesh's axes and views, a tensor-parallel group from
what a caller may pass, and a decision the group's first rank takes for all of them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Backend as C10dBackend
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from tp_train.parallel.agreement import rebuilt_error
from tp_train.parallel.fake_ranks import fake_group

# The mesh's axes (built by tp_train.parallel.dims.ParallelDims, which says their order): data parallelism across
# replicas, context parallelism (each rank a share of every sequence) and tensor parallelism within one; parameters
# are replicated over both data and context parallelism.
DATA_PARALLEL, TENSOR_PARALLEL = "data_parallel", "tensor_parallel"
CONTEXT_PARALLEL = "context_parallel"
# The data-parallel axis's two parts: ranks holding whole copies of a shard (DDP, HSDP's outer axis) and ranks
# splitting it (FSDP2); `DATA_PARALLEL` is the two flattened.
DATA_REPLICATE, DATA_SHARD = "data_parallel_replicate", "data_parallel_shard"
# Pipeline stages, the outermost axis: only activations cross it, once per microbatch, so it can span nodes.
PIPELINE_PARALLEL = "pipeline_parallel"
REPLICAS = "data_context_parallel"  # data x context parallel, flattened: the group gradients are averaged over
# HSDP's inner axis: data shard x context parallel, flattened: the ranks FSDP2 splits a shard over when it is also
# replicated over `DATA_REPLICATE` (with cp > 1 the context ranks hold the same parameters, so they split them too)
SHARD_GROUP = "data_context_shard"
# Expert parallelism, a view over the replicas (data x context): runs of `expert_parallel_size` consecutive replicas
# each hold all of the experts between them; the ranks at one place of every run hold the same experts (replicas).
EXPERT_PARALLEL, EXPERT_REPLICAS = "expert_parallel", "expert_data_parallel"
# How the data-parallel axis holds a tensor-parallel shard: whole on every rank (DDP), or split over it (FSDP2).
DATA_PARALLEL_MODES = ("ddp", "fsdp")


def as_process_group(tp_group: ProcessGroup | DeviceMesh | None) -> ProcessGroup:
    """A process group from a ProcessGroup, a 1-D DeviceMesh, or None (the whole world)."""
    if tp_group is None:
        if not dist.is_initialized():
            raise RuntimeError("parallelize needs torch.distributed initialised (or an explicit tp_group)")
        return dist.group.WORLD
    if isinstance(tp_group, DeviceMesh):
        if tp_group.ndim != 1:
            raise ValueError(f"tp_group must be a 1-D DeviceMesh, got mesh_dim_names={tp_group.mesh_dim_names}")
        return tp_group.get_group()
    return tp_group


def backend_with_timeout(backend: str, timeout: timedelta | None) -> tuple[str, Any] | None:
    """`backend` ("nccl", "gloo") with options timing out after `timeout`, as `init_device_mesh`'s backend override
    takes it; None without a timeout (torch's defaults)."""
    if timeout is None:
        return None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
    else:
        options = C10dBackend.Options(backend, timeout)
    return backend, options


def first_rank_decides(decide: Callable[[], Any], group: ProcessGroup | None = None) -> Any:
    """`decide()` run on the group's first rank only and its result returned on every rank (a broadcast); when it
    raises, the first rank raises its error and every other rank the same type with the same message."""
    if fake_group(group):  # a simulation's one process is every rank: each decides as the first would
        return decide()
    decision: list = [None]
    if dist.get_rank(group) == 0:
        try:
            decision[0] = ("value", decide())
        except Exception as error:
            dist.broadcast_object_list([("error", type(error), str(error))], group=group, group_src=0)
            raise
    dist.broadcast_object_list(decision, group=group, group_src=0)
    if decision[0][0] == "error":
        raise rebuilt_error(*decision[0][1:])
    return decision[0][1]
