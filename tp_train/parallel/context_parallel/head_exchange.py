"""Trading sequence shards for head shards across a context-parallel group (the all-to-all of DeepSpeed-Ulysses,
arXiv 2309.14509): before attention each rank holds every head for its share of the tokens; after one all-to-all it
holds 1/cp of the heads for every token, in natural order, so that attention runs as on one process; a second
all-to-all brings the output back to sequence shards.

Each rank's share is two chunks of 2 x cp (`load_balance`): the tokens that arrive from rank s are chunks s and
2cp-1-s, copied straight to their places in the whole sequence. Each exchange holds one send and one receive buffer
beside its input and output, no other copy.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_to_all


def sequence_to_heads(tensors: tuple[torch.Tensor, ...], group: ProcessGroup) -> torch.Tensor:
    """Each of `tensors`, (B, H_i, T / cp, D): every head for this rank's share of the tokens -> one (B, sum_i H_i /
    cp, T, D): this rank's block of each one's heads (rank r: heads r H_i / cp .. (r + 1) H_i / cp - 1), side by side,
    for every token in natural order; one all-to-all for all of them. Backward: the reverse exchange."""
    return _ToHeads.apply(group, *tensors)


def heads_to_sequence(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """(B, H / cp, T, D) this rank's heads for every token -> (B, H, T / cp, D) every head for this rank's share of
    the tokens (the inverse of `sequence_to_heads` for one tensor). Backward: the reverse exchange."""
    return _ToSequence.apply(x, group)


class _ToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, *tensors):
        ctx.group, ctx.heads = group, [t.shape[1] for t in tensors]
        return _natural_order(all_to_all(_head_blocks(tensors, group.size()), group))

    @staticmethod
    def backward(ctx, grad):
        received = all_to_all(_arrival_blocks(grad, ctx.group.size()), ctx.group)  # (cp, B, sum H_i / cp, Tl, D)
        grads, offset = [], 0
        for heads in ctx.heads:
            width = heads // ctx.group.size()
            grads.append(received[:, :, offset : offset + width].movedim(0, 1).flatten(1, 2))  # (B, H_i, Tl, D)
            offset += width
        return (None, *grads)


class _ToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_to_all(_arrival_blocks(x, group.size()), group).movedim(0, 1).flatten(1, 2)

    @staticmethod
    def backward(ctx, grad):
        return _natural_order(all_to_all(_head_blocks((grad,), ctx.group.size()), ctx.group)), None


def _head_blocks(tensors: tuple[torch.Tensor, ...], size: int) -> torch.Tensor:
    """The send buffer (cp, B, sum H_i / cp, Tl, D): block j holds rank j's heads of every tensor, side by side."""
    batch, _, share, dim = tensors[0].shape
    widths = [t.shape[1] // size for t in tensors]
    send = torch.empty(size, batch, sum(widths), share, dim, dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for tensor, width in zip(tensors, widths, strict=True):
        send[:, :, offset : offset + width] = tensor.unflatten(1, (size, width)).movedim(1, 0)
        offset += width
    return send


def _natural_order(received: torch.Tensor) -> torch.Tensor:
    """(cp, B, h, Tl, D), block s rank s's share of the tokens -> (B, h, T, D) in the sequence's order."""
    size, batch, heads, share, dim = received.shape
    chunk = share // 2
    out = received.new_empty(batch, heads, share * size, dim)
    for rank in range(size):
        for half, place in enumerate((rank, 2 * size - 1 - rank)):
            out[:, :, place * chunk : (place + 1) * chunk] = received[rank, :, :, half * chunk : (half + 1) * chunk]
    return out


def _arrival_blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """The inverse of `_natural_order`: (B, h, T, D) -> the send buffer (cp, B, h, Tl, D), block s rank s's share."""
    batch, heads, length, dim = x.shape
    chunk = length // (2 * size)
    send = x.new_empty(size, batch, heads, 2 * chunk, dim)
    for rank in range(size):
        for half, place in enumerate((rank, 2 * size - 1 - rank)):
            send[rank, :, :, half * chunk : (half + 1) * chunk] = x[:, :, place * chunk : (place + 1) * chunk]
    return send
