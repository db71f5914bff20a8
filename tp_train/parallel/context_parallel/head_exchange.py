"""Trading sequence shards for head shards across a context-parallel group (the all-to-all of DeepSpeed-Ulysses,
arXiv 2309.14509): before attention each rank holds every head for its share of the tokens; after one all-to-all it
holds 1/cp of the heads for every token, in natural order, so that attention runs as on one process; a second
all-to-all brings the output back to sequence shards.

Each rank's share is two chunks of 2 x cp (`load_balance`); the tokens that arrive, rank after rank, are put back in
their global order here, so the causal mask and the document ids of the whole sequence apply as they are.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_to_all
from tp_train.parallel.context_parallel.load_balance import local_positions


def sequence_to_heads(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, H, T / cp, D) every head of this rank's share of the tokens -> (B, H / cp, T, D) this rank's block of
    heads (rank r: heads r H / cp .. (r + 1) H / cp - 1) for every token, in natural order. Backward: the reverse
    exchange (`heads_to_sequence`) of the gradient."""
    return _Exchange.apply(x, group, True)


def heads_to_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The inverse of `sequence_to_heads`: (B, H / cp, T, D) -> (B, H, T / cp, D). Backward: `sequence_to_heads`."""
    return _Exchange.apply(x, group, False)


class _Exchange(torch.autograd.Function):
    """Forward: one all-to-all from sequence shards to head shards (`to_heads`) or back. Backward: the other way."""

    @staticmethod
    def forward(ctx, x, group, to_heads):
        ctx.group, ctx.to_heads = group, to_heads
        return _to_heads(x, group) if to_heads else _to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        grad = _to_sequence(grad, ctx.group) if ctx.to_heads else _to_heads(grad, ctx.group)
        return grad, None, None


def _to_heads(x, group):
    size = group.size()
    if size == 1:
        return x
    batch, heads, share, dim = x.shape
    send = x.unflatten(1, (size, heads // size)).movedim(1, 0)  # (cp, B, H / cp, Tl, D): block j for rank j
    received = all_to_all(send, group)  # block s: rank s's share of the tokens, for this rank's heads
    tokens = received.movedim(0, 2).flatten(2, 3)  # (B, H / cp, T, D), shares in rank order
    return tokens.index_select(2, _arrival_order(share * size, size, x.device).argsort())


def _to_sequence(x, group):
    size = group.size()
    if size == 1:
        return x
    batch, heads, length, dim = x.shape
    shares = x.index_select(2, _arrival_order(length, size, x.device))  # (B, H / cp, T, D), shares in rank order
    send = shares.unflatten(2, (size, length // size)).movedim(2, 0)  # (cp, B, H / cp, Tl, D): rank j's share
    received = all_to_all(send, group)  # block s: this rank's share of the tokens, for rank s's heads
    return received.movedim(0, 1).flatten(1, 2)  # (B, H, Tl, D)


def _arrival_order(length: int, size: int, device) -> torch.Tensor:
    """The global positions of the tokens as they arrive: every rank's share (`shard_sequence` order), by rank."""
    return torch.cat([local_positions(length, size, rank, device) for rank in range(size)])
