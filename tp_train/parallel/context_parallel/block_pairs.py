"""Which fused attention calls one rank's queries make against one source rank's keys, with no dense mask.

Each rank holds two chunks of the sequence (`load_balance.chunk_indices`). A pair (query chunk, key chunk) is, by
the chunks' global order: skipped when causal and the keys come after the queries, a diagonal block (one causal
call) when it is the same chunk, else a full block (one call without a mask). With packed documents, a pair runs
one call per document present in both chunks, on that document's rows and columns only, so tokens of different
documents are never scored together and fully masked pairs cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tp_train.parallel.context_parallel.load_balance import chunk_indices

# The most query rows and key columns one fused call takes: a call's transient buffers (its output, its gradients,
# the kernel's own) grow with its rows and columns, so larger blocks are tiled; 1,024 keeps a CPU kernel as fast
# as on whole chunks (measured at 16k tokens, docs/long-sequences.md).
TILE = 1024


@dataclass(frozen=True)
class BlockCall:
    """One fused call: q[batch, :, rows] against k, v[batch, :, columns] of the source's share."""

    batch: slice  # batch rows (all of them when every row packs the same documents)
    rows: slice  # query positions in this rank's share
    columns: slice  # key positions in the source rank's share
    causal: bool  # a diagonal block: query i sees keys 0..i


class BlockPairs:
    """The calls of this rank's queries against every source rank's keys.

    Args:
        share_length: tokens per rank (T / cp), two chunks of share_length / 2.
        size, rank: the context-parallel group's size and this rank's index in it.
        causal: keys after the query (by global position) are masked.
        documents: (B, cp, share_length) every rank's share of the document ids (non-decreasing along the
            sequence), or None for one document per row.
        tile: the most rows and columns of one call.
    """

    def __init__(
        self, share_length: int, size: int, rank: int, causal: bool, documents: torch.Tensor | None, tile: int = TILE
    ):
        self.chunk, self.size, self.rank, self.causal, self.tile = share_length // 2, size, rank, causal, tile
        self.rows = [slice(None)]
        self.spans = None  # spans[row][source][chunk]: {document id: slice of that chunk's positions}
        if documents is not None:
            documents = documents.cpu()
            if bool((documents == documents[:1]).all()):
                documents = documents[:1]  # every batch row packs the same documents: one call serves them all
            else:
                self.rows = [slice(b, b + 1) for b in range(documents.shape[0])]
            self.spans = [[[_spans(ids) for ids in share.split(self.chunk)] for share in row] for row in documents]

    def calls(self, source: int) -> list[BlockCall]:
        """The fused calls against `source`'s keys, in tiles of at most TILE rows and columns."""
        calls = []
        mine, theirs = chunk_indices(self.size, self.rank), chunk_indices(self.size, source)
        for i, query_chunk in enumerate(mine):
            for j, key_chunk in enumerate(theirs):
                if self.causal and key_chunk > query_chunk:
                    continue  # every key comes after every query
                diagonal = self.causal and key_chunk == query_chunk
                rows, columns = self._chunk(i), self._chunk(j)
                if self.spans is None:
                    calls.append(BlockCall(self.rows[0], rows, columns, diagonal))
                    continue
                for batch, spans in zip(self.rows, self.spans, strict=True):
                    keys = spans[source][j]
                    for document, query_span in spans[self.rank][i].items():
                        if document in keys:
                            key_span = keys[document]
                            calls.append(
                                BlockCall(batch, _shift(query_span, rows), _shift(key_span, columns), diagonal)
                            )
        return [tile for call in calls for tile in _tiles(call, self.tile)]

    def _chunk(self, index: int) -> slice:
        return slice(index * self.chunk, (index + 1) * self.chunk)


def _tiles(call: BlockCall, size: int) -> list[BlockCall]:
    """`call` in tiles of at most `size` rows and columns; a diagonal block's tiles above the diagonal are skipped."""
    rows, columns = range(call.rows.start, call.rows.stop, size), range(call.columns.start, call.columns.stop, size)
    tiles = []
    for i, row in enumerate(rows):
        for j, column in enumerate(columns):
            if call.causal and j > i:
                break  # a diagonal block is square and its tiles align: these keys all follow these queries
            tiles.append(
                BlockCall(
                    call.batch,
                    slice(row, min(row + size, call.rows.stop)),
                    slice(column, min(column + size, call.columns.stop)),
                    call.causal and i == j,
                )
            )
    return tiles


def _spans(ids: torch.Tensor) -> dict[int, slice]:
    """{document id: its positions} of one chunk's (non-decreasing) document ids."""
    documents, counts = torch.unique_consecutive(ids, return_counts=True)
    if len(set(documents.tolist())) < len(documents):
        raise ValueError(
            f"document ids {documents.tolist()} come back after another document's tokens; each packed document's "
            f"tokens must be contiguous (ids non-decreasing, as document_ids_from_separators gives)"
        )
    stops = counts.cumsum(0).tolist()
    return {
        doc: slice(stop - count, stop)
        for doc, count, stop in zip(documents.tolist(), counts.tolist(), stops, strict=True)
    }


def _shift(span: slice, chunk: slice) -> slice:
    return slice(chunk.start + span.start, chunk.start + span.stop)
