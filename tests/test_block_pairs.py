"""The fused calls `BlockPairs` plans cover exactly the (query, key) pairs the dense mask allows, each once, with the
causal flag only on square diagonal tiles: at cp 1, 2 and 4, with and without packed documents, tiled small enough
that every chunk splits into several tiles (documents then cross tiles, chunks and ranks)."""

from __future__ import annotations

import pytest
import torch

from tp_train.parallel.context_parallel import attention_mask, local_positions, shard_sequence
from tp_train.parallel.context_parallel.block_pairs import BlockPairs

LENGTH = 48
DOCUMENTS = [[5, 13, 2, 11, 17], [30, 1, 17]]  # per batch row


def _covered(size, rank, documents, tile):
    """(B, T / cp, T) how many calls score each (local query, global key) pair; and the square-causal check."""
    share = LENGTH // size
    pairs = BlockPairs(share, size, rank, True, documents, tile=tile)
    counts = torch.zeros(len(DOCUMENTS), share, LENGTH, dtype=torch.long)
    for source in range(size):
        keys = local_positions(LENGTH, size, source)
        for call in pairs.calls(source):
            rows, columns = range(share)[call.rows], keys[call.columns]
            assert len(rows) <= tile and len(columns) <= tile
            block = torch.ones(len(rows), len(columns), dtype=torch.long)
            if call.causal:
                assert len(rows) == len(columns) and local_positions(LENGTH, size, rank)[call.rows][0] == columns[0]
                block = block.tril()
            counts[call.batch, rows.start : rows.stop, columns] += block
    return counts


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("tile", [3, 4, 1024])
def test_calls_cover_the_mask_exactly_once(size, masked, tile):
    ids = torch.stack([torch.repeat_interleave(torch.arange(len(d)), torch.tensor(d)) for d in DOCUMENTS])
    positions = torch.arange(LENGTH)
    mask = attention_mask(positions, positions, ids if masked else None, ids if masked else None).expand(2, -1, -1)
    documents = torch.stack([shard_sequence(ids, size, r, dim=1) for r in range(size)], dim=1) if masked else None
    for rank in range(size):
        expected = shard_sequence(mask.long(), size, rank, dim=1)
        assert torch.equal(_covered(size, rank, documents, tile), expected), f"cp={size} rank {rank}"


def test_documents_out_of_order_are_refused():
    documents = torch.tensor([[[0, 1, 0, 0, 2, 2, 2, 2]]])  # document 0 comes back within a chunk
    with pytest.raises(ValueError, match="must be contiguous"):
        BlockPairs(8, 1, 0, True, documents)
