"""How a full tensor maps to one rank's shard, and back.

A `ShardSpec` describes the split of one parameter. Along `dim` the full tensor is the concatenation of
`sections` (one section for a plain column or row split; [q, k, v] for a fused attention projection; [gate, up]
for a packed MLP projection). Each section is split into `world_size` equal chunks and rank r holds chunk r of
every section, concatenated: that is what keeps a fused projection head-aware. A vocabulary split may pad its
single section up to a multiple of the world size (`padded=True`); padding rows are zero. `transposed` records
that the source module stored the weight transposed (Hugging Face's Conv1D), so `unshard` returns it in the
source layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_divisible(where: str, dimension: str, value: int, tensor_parallel_size: int) -> None:
    """Raises `ValueError` (one line: where, the dimension, its size and the sizes that would work) unless
    `tensor_parallel_size` divides `value`: every even split in tp_train asks this one question."""
    if value % tensor_parallel_size:
        raise ValueError(
            f"{where}: {dimension}={value} is not divisible by tensor_parallel_size={tensor_parallel_size}; "
            f"use a tensor_parallel_size in {divisors(value)}"
        )


def divisors(value: int) -> list[int]:
    """The tensor-parallel sizes (up to 64) that divide `value` evenly."""
    return [d for d in range(1, value + 1) if value % d == 0 and d <= 64]


@dataclass(frozen=True)
class SectionSlice:
    """What one rank holds of one section along the split dimension."""

    start: int  # where its rows begin in the full, unpadded tensor (past the end for a rank of padding only)
    real: int  # how many of its rows are real; the rest, up to `local`, is zero padding
    local: int  # how many rows it holds, padding included


def section_slice(full: int, local: int, rank: int, offset: int = 0) -> SectionSlice:
    """Rank `rank`'s rows of a section of `full` real rows held `local` per rank (chunk r; rows past `full` are
    padding), the section starting at `offset` in the whole tensor."""
    begin = min(rank * local, full)
    return SectionSlice(offset + begin, max(0, min(local, full - begin)), local)


@dataclass(frozen=True)
class ShardSpec:
    dim: int  # dimension of the (local-layout) parameter that is split
    sections: tuple[int, ...]  # full sizes of the packed sections along dim, in order
    padded: bool = False  # single section padded up to a multiple of the world size (vocabulary)
    transposed: bool = False  # the source module stores this 2-D weight transposed

    def local_sections(self, world_size: int) -> tuple[int, ...]:
        """How many rows every rank holds of each section."""
        if self.padded:
            return (ceil_div(self.sections[0], world_size),)
        return tuple(size // world_size for size in self.sections)

    def slices(self, rank: int, world_size: int) -> list[SectionSlice]:
        """Which rows of each section rank `rank` holds: its chunk r of every section, in order (torch.chunk's
        split; with `padded`, the last ranks' chunks end in zero rows)."""
        result, offset = [], 0
        for full, local in zip(self.sections, self.local_sections(world_size), strict=True):
            result.append(section_slice(full, local, rank, offset))
            offset += full
        return result

    def local_numel(self, full_shape: tuple[int, ...], world_size: int) -> int:
        """Elements of one rank's shard of a tensor of `full_shape` (in the local layout), padding included."""
        full_rows = full_shape[self.dim]
        return sum(self.local_sections(world_size)) * (math.prod(full_shape) // full_rows if full_rows else 0)


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of `full` (given in the parameter's local layout, i.e. already transposed if needed)."""
    pieces = []
    for section in full.split(list(spec.sections), dim=spec.dim):
        if spec.padded:
            extra = ceil_div(section.size(spec.dim), world_size) * world_size - section.size(spec.dim)
            pad = [0, 0] * (section.dim() - 1 - spec.dim) + [0, extra]
            section = F.pad(section, pad)
        pieces.append(section.chunk(world_size, dim=spec.dim)[rank])
    return torch.cat(pieces, dim=spec.dim).contiguous()


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, group: ProcessGroup) -> torch.Tensor:
    """Gathers every rank's shard and returns the full tensor in the source module's layout."""
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(gathered, local.contiguous(), group=group)
    local_sizes = list(spec.local_sections(world_size))
    per_rank = [shard.split(local_sizes, dim=spec.dim) for shard in gathered]
    sections = []
    for index, full_size in enumerate(spec.sections):
        section = torch.cat([pieces[index] for pieces in per_rank], dim=spec.dim)
        sections.append(section.narrow(spec.dim, 0, full_size))
    full = torch.cat(sections, dim=spec.dim)
    return full.t() if spec.transposed else full


def full_numel(local: torch.Tensor, spec: ShardSpec) -> int:
    """Elements of the full (unsharded, unpadded) tensor that `local` is a shard of."""
    return local.numel() // local.shape[spec.dim] * sum(spec.sections)


def data_parallel_shard_dim(local_shape: tuple[int, ...], spec: ShardSpec | None, data_parallel_size: int) -> int:
    """The dimension sharded data parallelism (FSDP2) splits a parameter of this rank's `local_shape` along.

    FSDP2's default is dim 0. A tensor-parallel shard split along dim 0 (column-parallel weights, vocabularies) is
    split along the largest other dimension that divides evenly instead (FSDP2 shards a dimension other than 0 only
    evenly), so that each rank's piece stays one box of the full tensor: its (dp, tp) placement is two `Shard`s of
    different dimensions, which checkpoints address directly. Without such a dimension (a 1-D shard such as a
    bias): 0, and a checkpoint gathers that tensor's tensor-parallel shard over the data-parallel ranks.
    """
    if spec is None or spec.dim != 0:
        return 0
    candidates = [d for d in range(1, len(local_shape)) if local_shape[d] % data_parallel_size == 0]
    return max(candidates, key=lambda d: local_shape[d], default=0)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own elements of `tensor`: the local piece of a DTensor (a parameter, gradient or optimizer state
    FSDP2 shards over the data-parallel ranks), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def named_sharded_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, ShardSpec]]:
    """Yields (name, parameter, spec) for every tensor-parallel shard in `model`, each shared parameter once."""
    seen = set()
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            param = getattr(module, param_name)
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield f"{module_name}.{param_name}" if module_name else param_name, param, spec


def full_state_dict(model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The unsharded model's `state_dict`, assembled on every rank (a collective: all ranks must call it).

    Sharded tensors are gathered and returned in the source modules' layout, so the result loads with
    `load_state_dict` into the model as it was before `parallelize`.
    """
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = spec
    state = model.state_dict()
    return {
        name: unshard_tensor(tensor, specs[name], group) if name in specs else tensor for name, tensor in state.items()
    }
