"""Which tokens of a sequence each context-parallel rank holds."""

from __future__ import annotations

import torch


def chunk_indices(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 x cp_size) that rank `cp_rank` holds, in order: (cp_rank, 2 x cp_size - 1 - cp_rank)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must be in [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def check_sequence_length(length: int, cp_size: int, what: str = "sequence length") -> None:
    """Raises a one-line error unless 2 x cp_size divides `length`."""
    if length % (2 * cp_size):
        lower = length - length % (2 * cp_size)
        raise ValueError(
            f"{what}={length} is not divisible by 2 x cp = {2 * cp_size} (each context-parallel rank holds two equal "
            f"chunks); use a multiple of {2 * cp_size}, e.g. {lower or 2 * cp_size}"
        )


def shard_sequence(x: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """Rank `cp_rank`'s share of `x` along `dim`: chunks cp_rank and 2cp-1-cp_rank of 2 x cp_size, concatenated.

    Args:
        x: a full sequence-length tensor (token ids, labels, positions, document ids, activations).
        cp_size: ranks in the context-parallel group; 2 x cp_size must divide x.shape[dim].
        cp_rank: this rank's index in the group.
        dim: the sequence dimension.
    """
    if cp_size == 1:
        return x
    check_sequence_length(x.shape[dim], cp_size)
    chunks = x.chunk(2 * cp_size, dim=dim)
    first, second = chunk_indices(cp_size, cp_rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def unshard_sequence(shares: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every rank's share (by rank), the inverse of `shard_sequence`."""
    cp_size = len(shares)
    if cp_size == 1:
        return shares[0]
    chunks: list[torch.Tensor | None] = [None] * (2 * cp_size)
    for rank, share in enumerate(shares):
        first, second = share.chunk(2, dim=dim)
        chunks[rank], chunks[2 * cp_size - 1 - rank] = first, second
    return torch.cat(chunks, dim=dim)


def local_positions(length: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global positions (0 .. length-1) of the tokens rank `cp_rank` holds, in its order: (length / cp,)."""
    return shard_sequence(torch.arange(length, device=device), cp_size, cp_rank, dim=0)
