"""What a checkpoint needs to know of pipeline stages: each rank holds only its stage's part of the model, under the
model's own names, so a checkpoint is the union of the stages' states and reshards across pp by name. Three facts
follow, each asked here: which names the other stages hold (`across_stages`), the whole model's name of each
parameter (`parameter_names`: a tied parameter on the last stage is the head's there, while the whole model names
it by the embedding's; its optimizer state is stored under that one name on every stage and at every pp), and the
mesh a stage's tensors are placed on (`stage_mesh`: every dimension but the pipeline's)."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from tp_train.parallel.mesh import PIPELINE_PARALLEL
from tp_train.parallel.pipeline.ties import TIED_NAMES


def across_stages(names: Iterable[str], mesh: DeviceMesh) -> list[str]:
    """`names` (this rank's) together with those the other ranks of the mesh's pipeline dimension hold, sorted; a
    collective over that dimension (every rank of it calls this). Without one (or at pp=1), `names` sorted."""
    names = sorted(set(names))
    dims = mesh.mesh_dim_names or ()
    if PIPELINE_PARALLEL not in dims or mesh.size(dims.index(PIPELINE_PARALLEL)) == 1:
        return names
    group = mesh.get_group(dims.index(PIPELINE_PARALLEL))
    gathered: list[list[str] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    return sorted({name for stage in gathered for name in stage or ()})


def stage_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The dimensions of `mesh` that a pipeline stage's tensors are split or replicated over: all but the pipeline's
    (`mesh` itself without one). Nothing is split along the pipeline dimension: each stage holds tensors of its own
    (a tied copy holds the values of the first stage's), so a Shard there would have DCP expect the other stages'
    ranks to save parts of them, which they never do. torchtitan likewise places a stage's DTensors without pp."""
    dims = mesh.mesh_dim_names or ()
    if PIPELINE_PARALLEL not in dims:
        return mesh
    return mesh[tuple(dim for dim in dims if dim != PIPELINE_PARALLEL)]


def parameter_names(model: nn.Module) -> dict[int, str]:
    """The name of each parameter of `model`, by `id()`, as the whole model names it: a tied parameter by its first
    name there (the embedding's), also on a pipeline stage that holds it only as its head (`TIED_NAMES`)."""
    whole: dict[str, str] = {}
    for prefix, module in model.named_modules():
        for name, names in getattr(module, TIED_NAMES, {}).items():
            whole[_joined(prefix, name)] = _joined(prefix, names[0])
    found: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        found.setdefault(id(param), whole.get(name, name))
    return found


def _joined(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
