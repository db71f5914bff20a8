"""What one step computes and sends on this rank, counted as it runs: the FLOPs of its matrix products and
attentions (torch's own FLOP formulas, `torch.utils.flop_counter`), the operations it dispatches, and every collective
by kind and process group with the bytes it moves. The step simulator counts a simulated step with it
(`tp_train.tools.simulate`) and the time model prices the counts (`tp_train.tools.step_time`); on real ranks it counts
the same (the benchmark's collectives per step).

A collective's bytes are its whole tensor's: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input,
an all-to-all's input, a point-to-point message; what each rank sends of it depends on the kind (the time model's
`wire_bytes`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, BROADCAST, POINT_TO_POINT = (
    "all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "point_to_point",
)  # fmt: skip
# The kind of each collective op the dispatcher sees, by name: c10d's (torch.distributed's), and the functional ones
# DTensor redistributes with. Waits and barriers move no data and are not counted.
_KINDS = {
    ALL_REDUCE: ("allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced"),
    ALL_GATHER: (
        "allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
        "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
    ),
    REDUCE_SCATTER: (
        "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
        "reduce_scatter_tensor_coalesced",
    ),
    ALL_TO_ALL: ("alltoall_", "alltoall_base_", "all_to_all_single"),
    BROADCAST: ("broadcast_", "broadcast"),
    POINT_TO_POINT: ("send", "recv_", "recv_any_source_"),
}  # fmt: skip
KIND_OF_OP = {op: kind for kind, ops in _KINDS.items() for op in ops}
OTHER_GROUP = "other"


@dataclass(frozen=True)
class Collective:
    """One kind of collective over one process group: `role` names the group (a `ParallelMesh` view's name, or
    "other"), `ranks` are its global ranks."""

    kind: str
    role: str
    ranks: tuple[int, ...]


@dataclass
class CollectiveCount:
    calls: int = 0
    bytes: int = 0  # summed over the calls, each its whole tensor's (see the module docstring)


class StepCounts(TorchDispatchMode):
    """Counts what runs while active: `flops` (of matrix products and attentions), `memory_traffic` (the bytes the
    other operations read and write: elementwise, norms, copies, the optimizer; views move none), `operations`
    (dispatched ops) and `collectives` ({Collective: its calls and bytes}). `roles` maps a process group's name to the
    role its collectives are filed under."""

    def __init__(self, roles: Mapping[str, str] | None = None) -> None:
        super().__init__()
        self.roles = dict(roles or {})
        self.reset()

    def reset(self) -> None:
        self.flops = 0
        self.memory_traffic = 0
        self.operations = 0
        self.collectives: dict[Collective, CollectiveCount] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.operations += 1
        role = _ROLE_OF_OP.get(func)
        if role is None:
            role = _ROLE_OF_OP[func] = _role(func)
        if role == _VIEW:
            return out
        if role not in (_FLOPS, _TRAFFIC):
            self._collective(role, args, kwargs)
            return out
        # a DTensor's FLOPs and bytes are its shard's: what this rank computes and moves
        local_args, local_kwargs, local_out = tree_map_only(torch.Tensor, _local, (args, kwargs, out))
        if role == _FLOPS:
            self.flops += flop_registry[func._overloadpacket](*local_args, **local_kwargs, out_val=local_out)
        else:
            self.memory_traffic += _bytes((local_args, local_kwargs, local_out))
        return out

    def _collective(self, kind: str, args, kwargs) -> None:
        group = _group(args, kwargs)
        if group is None or group.size() == 1:
            return
        ranks = tuple(dist.get_process_group_ranks(group))
        key = Collective(kind, self.roles.get(group.group_name, OTHER_GROUP), ranks)
        count = self.collectives.setdefault(key, CollectiveCount())
        count.calls += 1
        count.bytes += max(_bytes(arg) for arg in (*args, *kwargs.values()))

    @property
    def collective_calls(self) -> int:
        return sum(count.calls for count in self.collectives.values())

    @property
    def collective_bytes(self) -> int:
        return sum(count.bytes for count in self.collectives.values())


_FLOPS, _TRAFFIC, _VIEW = "flops", "traffic", "view"
_ROLE_OF_OP: dict = {}  # each op's role, decided on its first dispatch (the checks cost more than the counting)


def _role(func) -> str:
    """What an op adds to the counts: a collective's kind, FLOPs, memory traffic, or nothing (a view)."""
    kind = KIND_OF_OP.get(func.__name__.split(".")[0]) if func.namespace in ("c10d", "_c10d_functional") else None
    if kind is not None:
        return kind
    if func._overloadpacket in flop_registry:
        return _FLOPS
    return _VIEW if _is_view(func) else _TRAFFIC


def _is_view(func) -> bool:
    """Whether `func` returns a view of an input (it moves no data), as its schema says: an aliased return that
    is not written to (an in-place op's is)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _bytes(arg) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(arg) if isinstance(t, torch.Tensor))


def _group(args, kwargs) -> dist.ProcessGroup | None:
    """The process group of a collective op: c10d's take it as a script object, the functional ones by name."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg)
            except (RuntimeError, TypeError):
                continue
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, str):
            try:
                return dist.distributed_c10d._resolve_process_group(arg)
            except (RuntimeError, ValueError, KeyError):
                continue
    return None
