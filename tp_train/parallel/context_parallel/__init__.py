"""Context parallelism: each rank of a context-parallel (CP) group holds a load-balanced share of every sequence,
and attention runs across the group (ring attention, all-gathered keys and values, or an all-to-all from sequence
shards to head shards and back).
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
from tp_train.parallel.context_parallel.ring_attention import ROTATIONS, check_heads, context_parallel_attention

__all__ = [
    "ROTATIONS",
    "attention_mask",
    "check_heads",
    "chunk_indices",
    "context_parallel_attention",
    "document_ids_from_separators",
    "local_positions",
    "positions_within_documents",
    "shard_sequence",
    "unshard_sequence",
]
