"""How a full tensor maps to one rank's shard, and back."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from tp_train.parallel.agreement import before_collective


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


def check_sections(
    where: str,
    what: str,
    sections: tuple[int, ...],
    units: tuple[int | None, ...] | None,
    tensor_parallel_size: int,
    stored: bool = True,
) -> None:
    """Raises `ValueError` (one line) unless each section splits over `tensor_parallel_size` ranks: evenly, in whole
    units per rank, or (fewer units than ranks) each unit held whole by the same number of ranks and, for a tensor's
    rows (`stored`; not a count), splitting into that many pieces (what a checkpoint stores of each replica)."""
    tp = tensor_parallel_size
    for index, (size, unit) in enumerate(zip(sections, units or (None,) * len(sections), strict=True)):
        name = f"{what} section {index}" if len(sections) > 1 else what
        if unit is None:
            check_divisible(where, name, size, tp)
            continue
        whole = not unit % tp and not size % tp  # whole units on each rank
        replicated = unit < tp and not tp % unit and not (stored and (size // unit) % (tp // unit))
        if not (whole or replicated):
            raise ValueError(
                f"{where}: {name} holds {unit} heads or groups of {size // unit}, which tensor_parallel_size={tp} "
                f"neither splits into whole ones nor replicates evenly; use a tensor_parallel_size in "
                f"{divisors(unit)} or a multiple of {unit}" + (f" that divides {size}" if stored else "")
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
    units: tuple[int | None, ...] | None = None  # indivisible units (heads, groups) per section; fewer than ranks:
    # replicated (None for a section of no units)

    def replicas(self, world_size: int) -> tuple[int, ...]:
        """How many ranks hold each section's chunks alike: 1, or world_size / units for a replicated section."""
        units = self.units or (None,) * len(self.sections)  # None: a section split evenly (no units named)
        return tuple(world_size // unit if unit and unit < world_size else 1 for unit in units)

    def local_sections(self, world_size: int) -> tuple[int, ...]:
        """How many rows every rank holds of each section."""
        if self.padded:
            return (ceil_div(self.sections[0], world_size),)
        replicas = self.replicas(world_size)
        return tuple(size * copies // world_size for size, copies in zip(self.sections, replicas, strict=True))

    def slices(self, rank: int, world_size: int) -> list[SectionSlice]:
        """Which rows of each section rank `rank` holds: its chunk r of every section, in order (torch.chunk's
        split; with `padded`, the last ranks' chunks end in zero rows; a replicated section's chunk r / replicas)."""
        result, offset = [], 0
        sizes = zip(self.sections, self.local_sections(world_size), self.replicas(world_size), strict=True)
        for full, local, copies in sizes:
            result.append(section_slice(full, local, rank // copies, offset))
            offset += full
        return result


def shard_tensor(full: torch.Tensor, spec: ShardSpec, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of `full` (given in the parameter's local layout, i.e. already transposed if needed)."""
    pieces = []
    replicas = spec.replicas(world_size)
    for section, copies in zip(full.split(list(spec.sections), dim=spec.dim), replicas, strict=True):
        extra = ceil_div(section.size(spec.dim), world_size) * world_size - section.size(spec.dim)
        if spec.padded and extra:
            pad = [0, 0] * (section.dim() - 1 - spec.dim) + [0, extra]
            section = F.pad(section, pad)
        pieces.append(section.chunk(world_size // copies, dim=spec.dim)[rank // copies])
    if len(pieces) > 1:
        return torch.cat(pieces, dim=spec.dim)
    # One piece: no copy where it is the whole tensor (tp=1), one where it is a part (a view would keep the whole)
    piece = pieces[0]
    if piece.numel() == full.numel():
        return piece.contiguous()
    return piece.clone() if piece.is_contiguous() else piece.contiguous()


def shard_parameter(source: torch.Tensor, spec: ShardSpec, rank: int, world_size: int) -> torch.Tensor:
    """This rank's shard of a parameter as its module stores it (transposed first where `spec` says the module stores
    it the other way, as Conv1D does): what `apply_plan` gives each rank, and the rank simulation too."""
    return shard_tensor(source.detach().t() if spec.transposed else source.detach(), spec, rank, world_size)


def unshard_tensor(local: torch.Tensor, spec: ShardSpec, group: ProcessGroup) -> torch.Tensor:
    """Gathers every rank's shard and returns the full tensor in the source module's layout."""
    world_size = dist.get_world_size(group)
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    before_collective()
    dist.all_gather(gathered, local.contiguous(), group=group)
    full = join_shards(gathered, spec)
    return full.t() if spec.transposed else full


# The most bytes of this rank's shards that `unshard_tensors` gathers in one collective (the gathered buffer is
# tp times that): few collectives for a whole model's state, a bounded working copy for a large one.
UNSHARD_BUCKET_BYTES = 64 * 2**20


def unshard_tensors(
    shards: Sequence[tuple[torch.Tensor, ShardSpec]], group: ProcessGroup, bucket_bytes: int = UNSHARD_BUCKET_BYTES
) -> list[torch.Tensor]:
    """`unshard_tensor` of each (local shard, spec), in order, for one all-gather per bucket of shards instead of one
    per tensor: the shards of a dtype and device are flattened into one buffer of at most `bucket_bytes` (or one
    shard alone, if larger). Every rank passes the same tensors in the same order (a collective)."""
    world_size = dist.get_world_size(group)
    result: list[torch.Tensor | None] = [None] * len(shards)
    for bucket in _buckets(shards, bucket_bytes):
        if len(bucket) == 1 or any(isinstance(shards[index][0], DTensor) for index in bucket):
            for index in bucket:
                result[index] = unshard_tensor(*shards[index], group)
            continue
        flat = torch.cat([shards[index][0].detach().reshape(-1) for index in bucket])
        gathered = [torch.empty_like(flat) for _ in range(world_size)]
        before_collective()
        dist.all_gather(gathered, flat, group=group)
        offset = 0
        for index in bucket:
            local, spec = shards[index]
            pieces = [every[offset : offset + local.numel()].view(local.shape) for every in gathered]
            offset += local.numel()
            full = join_shards(pieces, spec)
            result[index] = full.t() if spec.transposed else full
    return result


def _buckets(shards: Sequence[tuple[torch.Tensor, ShardSpec]], bucket_bytes: int) -> list[list[int]]:
    """The indices of `shards`, in buckets of one dtype and device and at most `bucket_bytes` each."""
    open_buckets: dict[tuple, tuple[list[int], int]] = {}
    done = []
    for index, (local, _) in enumerate(shards):
        key, size = (local.dtype, local.device), local.numel() * local.element_size()
        bucket, held = open_buckets.get(key, ([], 0))
        if bucket and held + size > bucket_bytes:
            done.append(bucket)
            bucket, held = [], 0
        bucket.append(index)
        open_buckets[key] = (bucket, held + size)
    return done + [bucket for bucket, _ in open_buckets.values()]


def join_shards(shards: list[torch.Tensor], spec: ShardSpec) -> torch.Tensor:
    """The full tensor (in the parameter's local layout) from every rank's shard, in rank order: the inverse of
    `shard_tensor`, section by section, one replica of each, padding dropped."""
    world_size = len(shards)
    local_sizes = list(spec.local_sections(world_size))
    per_rank = [shard.split(local_sizes, dim=spec.dim) for shard in shards]
    sections = []
    for index, (full_size, copies) in enumerate(zip(spec.sections, spec.replicas(world_size), strict=True)):
        section = torch.cat([pieces[index] for pieces in per_rank[::copies]], dim=spec.dim)  # one replica each
        sections.append(section.narrow(spec.dim, 0, full_size))
    return torch.cat(sections, dim=spec.dim)


def replicated_rows(spec: ShardSpec, world_size: int) -> list[tuple[int, int, int]]:
    """(first row in the local shard, rows, replicas) of each section that `world_size` ranks replicate."""
    found, start = [], 0
    for local, copies in zip(spec.local_sections(world_size), spec.replicas(world_size), strict=True):
        if copies > 1:
            found.append((start, local, copies))
        start += local
    return found


def split_among_replicas(local: torch.Tensor, spec: ShardSpec, world_size: int) -> torch.Tensor:
    """`local` (this rank's shard of a tensor) with each replicated section divided by its replica count: the ranks'
    shards then sum to the full tensor, as the partial gradients of replicas do."""
    local = local.clone()
    for start, rows, copies in replicated_rows(spec, world_size):
        local.narrow(spec.dim, start, rows).div_(copies)
    return local


def sum_replicated_gradient(grad: torch.Tensor, spec: ShardSpec, group: ProcessGroup) -> torch.Tensor:
    """Not autograd: a gradient hook. Each replicated section's gradient summed over the ranks holding it (each
    replica computed it from its own query heads only): the sections are laid out at their unit's place in one
    full-size buffer, all-reduced over the group, and read back; other sections are returned as they are."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    replicated = replicated_rows(spec, world_size)
    if not replicated:
        return grad
    pieces = [grad.narrow(spec.dim, start, rows) for start, rows, _ in replicated]
    units = [world_size // copies for *_, copies in replicated]
    buffer = torch.cat(
        [torch.cat([piece if unit == rank // (world_size // count) else torch.zeros_like(piece)
                    for unit in range(count)], dim=spec.dim)
         for piece, count in zip(pieces, units, strict=True)],
        dim=spec.dim,
    )  # fmt: skip
    before_collective()
    dist.all_reduce(buffer, group=group)
    grad = grad.clone()
    offset = 0
    for (start, rows, copies), count in zip(replicated, units, strict=True):
        unit = rank // copies
        grad.narrow(spec.dim, start, rows).copy_(buffer.narrow(spec.dim, offset + unit * rows, rows))
        offset += count * rows
    return grad


@torch.no_grad()
def fill_replicas(local: torch.Tensor, spec: ShardSpec, group: ProcessGroup) -> None:
    """Completes, in place, the replicated sections of `local` (this rank's shard) from the piece each replica holds
    (replica j of a head its j-th 1/replicas of the rows, as a checkpoint loads them): a collective."""
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    replicated = replicated_rows(spec, world_size)
    if not replicated:
        return
    gathered = [torch.empty_like(local) for _ in range(world_size)]
    before_collective()
    dist.all_gather(gathered, local.contiguous(), group=group)
    for start, rows, copies in replicated:
        piece, first = rows // copies, rank - rank % copies
        for replica in range(copies):
            source = gathered[first + replica].narrow(spec.dim, start + replica * piece, piece)
            local.narrow(spec.dim, start + replica * piece, piece).copy_(source)


def full_numel(local: torch.Tensor, spec: ShardSpec) -> int:
    """Elements of the full (unsharded, unpadded) tensor that `local` is a shard of."""
    return local.numel() // local.shape[spec.dim] * sum(spec.sections)


def data_parallel_shard_dim(local_shape: tuple[int, ...], spec: ShardSpec | None, data_parallel_size: int) -> int:
    """The dimension sharded data parallelism (FSDP2) splits a parameter of this rank's `local_shape` along."""
    if spec is None or spec.dim != 0:
        return 0
    candidates = [d for d in range(1, len(local_shape)) if local_shape[d] % data_parallel_size == 0]
    return max(candidates, key=lambda d: local_shape[d], default=0)


def data_parallel_split(tensor: DTensor) -> tuple[int, Shard]:
    """The mesh dimension FSDP2 splits `tensor` over, and how: the only one of a 1-D mesh, or the shard axis of
    HSDP's (replicate, shard) mesh, whose other axis holds whole copies (`Replicate`)."""
    (split,) = [(dim, placement) for dim, placement in enumerate(tensor.placements) if placement.is_shard()]
    return split


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's own elements of `tensor`: the local piece of a DTensor (a parameter, gradient or optimizer state
    FSDP2 shards over the data-parallel ranks), else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def named_sharded_parameters(model: nn.Module, buffers: bool = False) -> Iterator[tuple[str, nn.Parameter, ShardSpec]]:
    """Yields (name, parameter, spec) for every tensor-parallel shard in `model`, each shared parameter once; with
    `buffers`, split buffers too (Falcon-H1's `mup_vector`, which no optimizer or gradient sees)."""
    seen = set()
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            param = getattr(module, param_name)
            if id(param) in seen or not (buffers or param_name in module._parameters):
                continue
            seen.add(id(param))
            yield f"{module_name}.{param_name}" if module_name else param_name, param, spec


def full_state_dict(model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """The unsharded model's `state_dict`, assembled on every rank (a collective: all ranks must call it)."""
    specs = {}
    for module_name, module in model.named_modules():
        for param_name, spec in getattr(module, "shard_specs", {}).items():
            specs[f"{module_name}.{param_name}" if module_name else param_name] = spec
    state = model.state_dict()
    sharded = [name for name in state if name in specs]
    gathered = unshard_tensors([(state[name], specs[name]) for name in sharded], group)
    return {**state, **dict(zip(sharded, gathered, strict=True))}
