"""Autograd-aware collectives for a tensor-parallel process group."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup

from tp_train.parallel.agreement import before_collective
from tp_train.parallel.sharding import check_divisible

SEQUENCE_DIM = 1  # activations are (batch, sequence, hidden)
# The profiler range around each eager collective: the time this thread spends issuing it and waiting for it
# (the benchmark sums it per step; compiled code waits in `_c10d_functional::wait_tensor` instead).
COLLECTIVE_RANGE = "tp_train::collective"
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x: torch.Tensor, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """Not autograd: `x` reduced over the group (`op` "sum" or "max"), in place when eager and contiguous (use
    the result)."""
    if group.size() > 1:
        if torch.compiler.is_compiling():
            return funcol.all_reduce(x, op, group)
        x = x.contiguous()
        before_collective()
        with torch.profiler.record_function(COLLECTIVE_RANGE):
            dist.all_reduce(x, op=_REDUCE_OPS[op], group=group)
    return x


def all_to_all(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Not autograd: `x` (size x ...) cut along dim 0 into one block per rank, block j sent to rank j; the result's
    block s is what rank s sent this rank (its own size x ... tensor's block for this rank). Applied to the result,
    the same exchange sends every block back (the backward of an all-to-all is the reverse all-to-all). Gloo sends
    CUDA tensors through the host."""
    world_size = group.size()
    if world_size == 1:
        return x
    check_divisible("an all-to-all", "dimension 0", x.size(0), world_size)
    x = x.contiguous()
    if torch.compiler.is_compiling():
        return funcol.all_to_all_single(x, None, None, group)
    device = x.device
    if device.type != "cpu" and dist.get_backend(group) == "gloo":
        x = x.cpu()
    out = torch.empty_like(x)
    before_collective()
    with torch.profiler.record_function(COLLECTIVE_RANGE):
        dist.all_to_all_single(out, x, group=group)
    return out.to(device)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's contiguous chunk of `x` along `dim`."""
    world_size = group.size()
    if world_size == 1:
        return x
    check_divisible("a collective along a split dimension", f"dimension {dim}", x.size(dim), world_size)
    return x.chunk(world_size, dim=dim)[group.rank()].contiguous()


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Concatenation of every rank's `x` along `dim`, in rank order."""
    world_size = group.size()
    if world_size == 1:
        return x
    x = x.contiguous()
    if torch.compiler.is_compiling():
        out = funcol.all_gather_tensor(x, 0, group)
    else:
        out = x.new_empty((world_size * x.size(0), *x.shape[1:]))
        before_collective()
        with torch.profiler.record_function(COLLECTIVE_RANGE):
            all_gather_single(out, x, group=group)
    if dim % x.dim() == 0:
        return out
    return torch.cat(out.chunk(world_size), dim=dim)  # one copy, and the result is contiguous


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    """Sum over ranks of `x`, of which this rank keeps its chunk along `dim`."""
    world_size = group.size()
    if not torch.compiler.is_compiling() or world_size == 1:
        return reduce_scatter_async(x, dim, group).wait()
    check_divisible("a collective along a split dimension", f"dimension {dim}", x.size(dim), world_size)
    return funcol.reduce_scatter_tensor(x.movedim(dim, 0).contiguous(), "sum", 0, group).movedim(0, dim)


def _identity(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return x


def _sum(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return x  # nothing to sum, so no copy to protect the argument either
    return all_reduce(x.clone(), group)


def _sum_in_place(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    return all_reduce(x, group)


_COMMUNICATING = (_sum, _sum_in_place, _all_gather, _reduce_scatter)


class CommunicationCounter:
    """Bytes and calls of the collectives made through this module on behalf of one model."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.bytes = 0
        self.calls = 0

    def record(self, op, x: torch.Tensor, y: torch.Tensor, group: ProcessGroup) -> None:
        if op in _COMMUNICATING and group.size() > 1 and not torch.compiler.is_compiling():
            passes = 2 if op in (_sum, _sum_in_place) else 1
            self.bytes += passes * max(x.numel(), y.numel()) * x.element_size()
            self.calls += 1


class PendingCollective:
    """A collective started with `async_op=True`: it runs on the backend's own thread (gloo) or stream (NCCL) while
    the caller computes; `wait()` blocks until it is done and returns its result. The profiler shows the launch
    and the wait (the time the caller spent blocked on it) as `COLLECTIVE_RANGE`."""

    def __init__(self, work, result: torch.Tensor, finish=None):
        self.work, self.result, self.finish = work, result, finish

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            with torch.profiler.record_function(COLLECTIVE_RANGE):
                self.work.wait()
        return self.finish(self.result) if self.finish is not None else self.result


def all_reduce_async(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> PendingCollective:
    """Not autograd: starts the sum of `x` over the group, on a copy of `x` (the backward of `f`,
    `copy_to_tensor_parallel_region`, started early). Counted as `f`'s all-reduce."""
    if group.size() == 1:
        return PendingCollective(None, x)
    out = x.clone(memory_format=torch.contiguous_format)
    if counter is not None:
        counter.record(_sum, x, out, group)
    before_collective()
    with torch.profiler.record_function(COLLECTIVE_RANGE):
        work = dist.all_reduce(out, group=group, async_op=True)
    return PendingCollective(work, out)


def reduce_scatter_async(
    x: torch.Tensor, dim: int, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> PendingCollective:
    """Not autograd: starts the sum over the group of `x`, of which this rank keeps its chunk along `dim` (the
    backward of `gather_from_sequence_parallel_region`, started early). Counted as that reduce-scatter."""
    world_size = group.size()
    if world_size == 1:
        return PendingCollective(None, x)
    check_divisible("a collective along a split dimension", f"dimension {dim}", x.size(dim), world_size)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.size(0) // world_size, *moved.shape[1:]))
    if counter is not None:
        counter.record(_reduce_scatter, x, out, group)
    before_collective()
    with torch.profiler.record_function(COLLECTIVE_RANGE):
        work = reduce_scatter_single(out, moved, group=group, async_op=True)
    return PendingCollective(work, out, lambda result: result.movedim(0, dim))


class _ConjugatePair(torch.autograd.Function):
    """Applies `forward_op` to the input and `backward_op` to the gradient; each op is `(tensor, dim, group)`.
    An optional `CommunicationCounter` records both."""

    @staticmethod
    def forward(ctx, x, forward_op, backward_op, dim, group, counter=None):
        ctx.backward_op, ctx.dim, ctx.group, ctx.counter = backward_op, dim, group, counter
        y = forward_op(x, dim, group)
        if forward_op is _sum_in_place and y is x:
            ctx.mark_dirty(x)
        if counter is not None:
            counter.record(forward_op, x, y, group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad_input = ctx.backward_op(grad, ctx.dim, ctx.group)
        if ctx.counter is not None:
            ctx.counter.record(ctx.backward_op, grad, grad_input, ctx.group)
        return grad_input, None, None, None, None, None


def _conjugate_pair(x, forward_op, backward_op, dim, group, counter):
    if group.size() == 1:
        return x  # every op is the identity on one rank: no autograd node either
    return _ConjugatePair.apply(x, forward_op, backward_op, dim, group, counter)


def all_reduce_gradient(grad: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Not autograd: the sum over the group of a parameter's partial gradients (a gradient hook), for a replicated
    parameter that each rank applies to its own shard only (e.g. a norm over head_dim inside attention)."""
    return _sum(grad, -1, group)


def copy_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Megatron's `f`. Forward: identity (the replicated input enters a sharded region).
    Backward: all-reduce, summing the partial input gradients of every rank's shard."""
    return _conjugate_pair(x, _identity, _sum, -1, group, counter)


def reduce_from_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Megatron's `g`. Forward: all-reduce (sum) of every rank's partial output.
    Backward: identity (the gradient of a replicated output is already replicated)."""
    return _conjugate_pair(x, _sum, _identity, -1, group, counter)


def reduce_from_tensor_parallel_region_(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """`reduce_from_tensor_parallel_region` that all-reduces `x` in place instead of a copy of it, for a layer
    that owns `x` (a fresh output that nothing saved for backward). Forward: in-place all-reduce (sum), returns `x`.
    Backward: identity."""
    return _conjugate_pair(x, _sum_in_place, _identity, -1, group, counter)


def sum_across_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """A partial sum that every rank goes on to use (the sum of squares of a norm over features split across ranks).
    Forward: all-reduce (sum) of every rank's partial value. Backward: all-reduce (sum) of the gradient: each rank's
    partial value feeds every rank's total, so its gradient is the sum of every rank's gradient of the total (unlike
    `g`, whose output is then used identically on every rank, and so whose gradient is already whole)."""
    return _conjugate_pair(x, _sum, _sum, -1, group, counter)


def reduce_scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """A row layer's partial outputs of which each rank uses only its own share of the features (Doge's dt_proj: every
    rank's values feed one output per kv head, and each rank's attention reads its own heads'). Forward:
    reduce-scatter along the last dim, summing every rank's partial output and keeping this rank's chunk of it.
    Backward: all-gather of the gradient chunks along the last dim (each rank's partial output feeds every rank's
    chunk of the sum)."""
    return _conjugate_pair(x, _reduce_scatter, _all_gather, -1, group, counter)


def scatter_to_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Forward: keep this rank's chunk of the last dim of a replicated tensor.
    Backward: all-gather the gradient chunks along the last dim."""
    return _conjugate_pair(x, _split, _all_gather, -1, group, counter)


def gather_from_tensor_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Forward: all-gather a last-dim-sharded tensor into the full, replicated tensor.
    Backward: keep this rank's chunk of the gradient's last dim (no communication)."""
    return _conjugate_pair(x, _all_gather, _split, -1, group, counter)


def scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Forward: keep this rank's chunk of the sequence dim of a replicated (batch, seq, hidden) tensor.
    Backward: all-gather the gradient chunks along the sequence dim."""
    return _conjugate_pair(x, _split, _all_gather, SEQUENCE_DIM, group, counter)


def gather_from_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Sequence parallelism's replacement for `f`. Forward: all-gather the sequence shards into the full sequence.
    Backward: reduce-scatter, summing the partial gradients and keeping this rank's sequence chunk."""
    return _conjugate_pair(x, _all_gather, _reduce_scatter, SEQUENCE_DIM, group, counter)


def reduce_scatter_to_sequence_parallel_region(
    x: torch.Tensor, group: ProcessGroup, counter: CommunicationCounter | None = None
) -> torch.Tensor:
    """Sequence parallelism's replacement for `g`. Forward: reduce-scatter, summing every rank's partial output and
    keeping this rank's sequence chunk. Backward: all-gather the gradient along the sequence dim."""
    return _conjugate_pair(x, _reduce_scatter, _all_gather, SEQUENCE_DIM, group, counter)
