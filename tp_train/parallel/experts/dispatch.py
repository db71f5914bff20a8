"""Sending each token to the rank that holds its expert, and its expert's output back (expert parallelism).

The experts are split in contiguous runs over the expert-parallel group: rank r holds experts
[r * local, (r + 1) * local). A token routed to k experts is sent k times, once per (token, expert) assignment.
Dispatch sorts the assignments by expert (so each rank's share is one contiguous piece, its experts in order),
exchanges the counts per expert first and then the tokens (`all_to_all_single`), and orders what arrived by local
expert. Combine undoes each step in reverse and sums each token's expert outputs, weighted by its router weights.
No step loops over experts in Python: sorting and `bincount` do the grouping.

Dropless by default. With a `capacity` (rows per expert from one rank; `expert_capacity` from a capacity factor),
each expert takes the first `capacity` of a rank's assignments to it in token order (Switch Transformer's
first-come order, arXiv 2101.03961); the rest are dropped: not sent, their expert's output counted as 0 (the
residual carries the token on), no gradient to their router weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.agreement import before_collective


class _AllToAll(torch.autograd.Function):
    """Forward: rank i's `input_splits[j]` rows go to rank j, arriving as `output_splits[i]` rows there.
    Backward: the gradients travel the opposite way (the same exchange with the splits swapped)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad.contiguous(), output_splits, input_splits, ctx.group), None, None, None


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    before_collective()
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: ProcessGroup):
    """Autograd-aware `all_to_all_single` along dim 0 with the given row counts per rank."""
    if dist.get_world_size(group) == 1:
        return x
    return _AllToAll.apply(x, output_splits, input_splits, group)


@dataclass(frozen=True)
class Dispatched:
    """What combine needs to send a dispatch's outputs back: the assignments' order, and the row counts."""

    order: torch.Tensor  # (assignments,) assignment index of each sorted row, sorted by expert
    arrived_order: torch.Tensor  # (received,) row of the received tokens that each local-expert-sorted row came from
    sent: list[int]  # rows sent to each rank
    received: list[int]  # rows received from each rank
    tokens: int  # tokens before dispatch (T)
    dropped: int = 0  # assignments over capacity, not sent


def expert_capacity(capacity_factor: float, tokens: int, top_k: int, num_experts: int) -> int:
    """Rows each expert takes from one rank: `capacity_factor` times an even share of its `tokens` x `top_k`
    assignments, rounded up (GShard's and Switch Transformer's capacity)."""
    return math.ceil(capacity_factor * tokens * top_k / num_experts)


def dispatch(
    hidden: torch.Tensor, expert_index: torch.Tensor, num_experts: int, group: ProcessGroup, capacity: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Dispatched]:
    """Sends every (token, expert) assignment to the rank holding its expert (a collective over `group`).

    Args:
        hidden: (T, D) this rank's tokens.
        expert_index: (T, k) the experts each token is routed to, global ids in [0, num_experts).
        num_experts: experts in all, a multiple of the group's size.
        group: the expert-parallel group.
        capacity: at most this many of this rank's assignments per expert (see the module docstring); None: all.

    Returns:
        (R, D) the tokens this rank's experts compute, grouped by local expert in order; (R,) their local expert
        ids; (local,) tokens per local expert; and the state `combine` takes."""
    world_size = dist.get_world_size(group)
    local = num_experts // world_size
    tokens, top_k = expert_index.shape
    experts = expert_index.reshape(-1)  # (T * k,) assignment a = token a // k, its (a % k)-th choice
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_experts)  # (num_experts,) assignments per expert
    dropped = 0
    if capacity is not None:
        first = torch.cumsum(counts, 0) - counts  # (num_experts,) each expert's first row in the sorted order
        place = torch.arange(len(order), device=order.device) - first[experts[order]]  # its place among its expert's
        kept = place < capacity
        dropped = int(len(order) - kept.sum())
        order, counts = order[kept], counts.clamp(max=capacity)
    if world_size > 1:
        arrived_counts = torch.empty_like(counts)  # (world_size * local,) per source rank, per local expert
        before_collective()
        dist.all_to_all_single(arrived_counts, counts, group=group)
    else:
        arrived_counts = counts
    sent = counts.view(world_size, local).sum(dim=1).tolist()
    arrived_counts = arrived_counts.view(world_size, local)
    received = arrived_counts.sum(dim=1).tolist()
    rows = all_to_all(hidden[order // top_k], received, sent, group)  # (R, D), by source rank, then local expert
    per_source = arrived_counts.reshape(-1)  # runs of rows: source 0's expert 0, its expert 1, ..., source 1's ...
    local_ids = torch.arange(local, device=hidden.device).repeat(world_size).repeat_interleave(per_source)
    arrived_order = torch.argsort(local_ids, stable=True)
    state = Dispatched(order, arrived_order, sent, received, tokens, dropped)
    return rows[arrived_order], local_ids[arrived_order], arrived_counts.sum(dim=0), state


def combine(output: torch.Tensor, weights: torch.Tensor, state: Dispatched, group: ProcessGroup) -> torch.Tensor:
    """The inverse of `dispatch` for the experts' outputs (a collective over `group`).

    Args:
        output: (R, D) the experts' outputs, in the order `dispatch` returned their tokens.
        weights: (T, k) each token's router weights, in the order of the `expert_index` it was dispatched with.
        state: what `dispatch` returned with the tokens.

    Returns:
        (T, D): each token's expert outputs weighted by its router weights and summed."""
    unsorted = torch.empty_like(output).index_copy(0, state.arrived_order, output)  # back to arrival order
    sent_back = all_to_all(unsorted, state.sent, state.received, group)  # (T * k, D), sorted by expert
    top_k = weights.shape[1]
    weighted = sent_back * weights.reshape(-1)[state.order].unsqueeze(-1).to(sent_back.dtype)
    out = output.new_zeros((state.tokens, output.shape[-1]))
    return out.index_add(0, state.order // top_k, weighted)
