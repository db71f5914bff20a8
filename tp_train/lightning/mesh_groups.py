"""The job's mesh and its process groups as `TensorParallelStrategy` offers them to Lightning and to the user's
LightningModule (a mixin before DDPStrategy): each a named view of the one mesh `ParallelDims.build_mesh` makes."""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from tp_train.parallel.dims import ParallelDims, ParallelMesh


class MeshGroups:
    """Mixin for a Lightning strategy holding `parallel_dims` and `_mesh` (None until `setup_environment`)."""

    _mesh: ParallelMesh | None = None
    parallel_dims: ParallelDims

    @property
    def mesh(self) -> ParallelMesh:
        """The job's mesh and its named views (`ParallelDims.build_mesh`)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the processes are initialised (setup_environment)")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.root

    @property
    def tensor_parallel_group(self) -> ProcessGroup:
        return self.mesh.tensor_parallel.get_group()

    @property
    def data_parallel_group(self) -> ProcessGroup:
        return self.mesh.data_parallel.get_group()

    @property
    def context_parallel_group(self) -> ProcessGroup:
        return self.mesh.context_parallel.get_group()

    @property
    def replica_group(self) -> ProcessGroup:
        """The data x context parallel ranks: those whose tokens differ, over which DDP (or FSDP2) averages."""
        return self.mesh.replicas.get_group()

    @property
    def pipeline_parallel_group(self) -> ProcessGroup:
        return self.mesh.pipeline_parallel.get_group()

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        data_parallel = self.mesh.data_parallel
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}
