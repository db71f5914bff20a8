"""What a checkpoint needs to know of pipeline stages: each rank holds only its stage's part of the model, under the
model's own names, so a checkpoint is the union of the stages' states and reshards across pp by name. Three facts
follow, each asked here: which names the other stages hold (`across_stages`), every name a parameter has (a tied
parameter on the last stage has only its head's name there, while the whole model's first name is the
embedding's: its optimizer state is saved under each, `parameter_names`), and which of them a checkpoint holds
(`names_in_checkpoint`)."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from tp_train.parallel.mesh import PIPELINE_PARALLEL


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


def parameter_names(model: nn.Module) -> dict[int, list[str]]:
    """Every name of each parameter of `model`, by `id()`: a tied parameter has several."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return names


def names_in_checkpoint(keys: Iterable[str], prefix: str) -> set[str]:
    """The dotted prefixes after `prefix` of a checkpoint's flattened `keys` (`optimizer_0.state.<parameter
    name>.<its state's key>`): every candidate parameter name the checkpoint holds state under."""
    found = set()
    for key in keys:
        if key.startswith(prefix):
            parts = key[len(prefix) :].split(".")
            found.update(".".join(parts[:end]) for end in range(1, len(parts)))
    return found
