"""Packed documents that never attend across each other."""

from __future__ import annotations

import torch


def document_ids_from_separators(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) document ids: 0 for the first document, then +1 after each `separator` token.

    Args:
        tokens: (B, T) token ids.
        separator: the end-of-text token id that closes each packed document.
    """
    ends = (tokens == separator).long()
    return ends.cumsum(dim=-1) - ends  # a separator closes its own document: the next token starts a new one


def positions_within_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) positions restarting at 0 at each document's first token, from (B, T) non-decreasing document ids."""
    length = document_ids.shape[-1]
    index = torch.arange(length, device=document_ids.device).expand_as(document_ids)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[..., 1:] = document_ids[..., 1:] != document_ids[..., :-1]
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=-1).values  # each token's document start
    return index - first


def attention_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_documents: torch.Tensor | None = None,
    key_documents: torch.Tensor | None = None,
    causal: bool = True,
) -> torch.Tensor | None:
    """Which keys each query may attend to: a bool mask (B or 1, Tq, Tk) (True = attend), or None for all.

    Args:
        query_positions, key_positions: (Tq,) and (Tk,) global positions in the packed block (not per document).
        query_documents, key_documents: (B, Tq) and (B, Tk) document ids, or None for one document.
        causal: keys after the query are masked.
    """
    mask = None
    if causal:
        mask = (key_positions[None, :] <= query_positions[:, None]).unsqueeze(0)  # (1, Tq, Tk)
    if query_documents is not None:
        same = query_documents[:, :, None] == key_documents[:, None, :]  # (B, Tq, Tk)
        mask = same if mask is None else mask & same
    return mask
