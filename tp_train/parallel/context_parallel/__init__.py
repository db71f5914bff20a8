"""Context parallelism: each rank of a context-parallel (CP) group holds a load-balanced share of every sequence,
and attention runs across the group (ring attention, or all-gathered keys and values).

- `load_balance`: which tokens each rank holds (2 x cp chunks, rank r holds chunks r and 2cp-1-r), sharding and
  unsharding sequences and their global positions.
- `document_mask`: document ids from end-of-text tokens, positions restarting per document, the dense mask.
- `ring_attention`: exact attention over the group's shares, forward and backward, causal and/or by document.

Imports nothing from tp_train above `parallel/`.
"""

from tp_train.parallel.context_parallel.document_mask import (
    attention_mask,
    document_ids_from_separators,
    positions_within_documents,
)
from tp_train.parallel.context_parallel.load_balance import (
    chunk_indices,
    local_positions,
    shard_sequence,
    unshard_sequence,
)
from tp_train.parallel.context_parallel.ring_attention import ROTATIONS, context_parallel_attention

__all__ = [
    "ROTATIONS",
    "attention_mask",
    "chunk_indices",
    "context_parallel_attention",
    "document_ids_from_separators",
    "local_positions",
    "positions_within_documents",
    "shard_sequence",
    "unshard_sequence",
]
