"""The context-parallel attention op on real gloo ranks equals one process's SDPA, forward and backward (fp32), under
every rotation (ring, allgather, alltoall).

Each rank holds its load-balanced share (chunks r and 2cp-1-r of 2cp) of q, k, v and the document ids; its output
and its shares of dq, dk, dv must equal the same shares of plain `scaled_dot_product_attention` over the whole
sequence with the same mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tp_train.parallel.context_parallel import (
    ROTATIONS,
    attention_mask,
    context_parallel_attention,
    positions_within_documents,
    shard_sequence,
    unshard_sequence,
)

LENGTH, HEAD_DIM = 32, 8  # 8 chunks of 4 at cp=4, 4 chunks of 8 at cp=2


def _inputs(q_heads, kv_heads, documents):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, q_heads, LENGTH, HEAD_DIM, generator=generator)
    k = torch.randn(2, kv_heads, LENGTH, HEAD_DIM, generator=generator)
    v = torch.randn(2, kv_heads, LENGTH, HEAD_DIM, generator=generator)
    grad = torch.randn(2, q_heads, LENGTH, HEAD_DIM, generator=generator)
    ids = None
    if documents is not None:  # lengths per document; row 1 packs them in reverse order
        rows = [torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)) for lengths in documents]
        ids = torch.stack(rows)
    return q, k, v, grad, ids


def _reference(q, k, v, grad, ids):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    positions = torch.arange(LENGTH, device=q.device)
    mask = attention_mask(positions, positions, ids, ids, causal=True)[:, None]  # (B or 1, 1, T, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def _rank_errors(rank, world_size, q_heads, kv_heads, documents, rotation, device="cpu", dtype=torch.float32):
    q, k, v, grad, ids = (None if t is None else t.to(device) for t in _inputs(q_heads, kv_heads, documents))
    q, k, v, grad = (t.to(dtype) for t in (q, k, v, grad))
    expected = _reference(q, k, v, grad, ids)
    share = lambda t: shard_sequence(t, world_size, rank, dim=2)  # noqa: E731
    q_l, k_l, v_l = (share(t).clone().requires_grad_() for t in (q, k, v))
    ids_l = None if ids is None else shard_sequence(ids, world_size, rank, dim=1)
    out = context_parallel_attention(q_l, k_l, v_l, dist.group.WORLD, document_ids=ids_l, rotation=rotation)
    out.backward(share(grad))
    got = (out.detach(), q_l.grad, k_l.grad, v_l.grad)
    assert all(tensor.dtype == dtype for tensor in got), [tensor.dtype for tensor in got]
    return [float((g - share(e)).abs().max()) for g, e in zip(got, expected, strict=True)]


# documents crossing chunk and rank boundaries, and one whose first document spans every rank's share
CASES = {
    "causal": (4, 4, None),
    "gqa_8q_2kv": (8, 2, None),  # at cp=4 alltoall repeats kv heads (2 < cp)
    "gqa_8q_1kv": (8, 1, None),  # one kv head: alltoall repeats it for every rank
    "documents": (4, 2, [[3, 7, 5, 9, 8], [8, 9, 5, 7, 3]]),
    "first_document_everywhere": (4, 4, [[27, 2, 3], [30, 1, 1]]),
    "documents_one_kv_head": (4, 1, [[5, 11, 16], [16, 11, 5]]),
}


FLOAT64_CASE = "documents"  # also run in float64 (precision=64): blocks merged in float64, to 1e-12
FLOAT64_EXACT = 1e-12


def _rank_all_errors(rank, world_size, device="cpu"):
    """Every case under every rotation on one set of ranks: {(case, rotation): [out, dq, dk, dv max errors]}, and
    FLOAT64_CASE in float64 ("float64 documents")."""
    errors = {
        (case, rotation): _rank_errors(rank, world_size, *CASES[case], rotation, device)
        for case in CASES
        for rotation in ROTATIONS
    }
    if device == "cpu":  # CUDA's fused attention takes no float64
        for rotation in ROTATIONS:
            errors[(f"float64 {FLOAT64_CASE}", rotation)] = _rank_errors(
                rank, world_size, *CASES[FLOAT64_CASE], rotation, device, torch.float64
            )
    return errors


def check_cp_attention(world_size, device="cpu"):
    by_rank = run_on_ranks(_rank_all_errors, world_size, device, timeout=300)
    for key in by_rank[0]:
        worst = max(max(errors[key]) for errors in by_rank)
        bound = FLOAT64_EXACT if key[0].startswith("float64") else 1e-5
        assert worst < bound, f"cp={world_size} {key}: max error {worst:.2e} (out, dq, dk, dv per rank: " + str(
            [errors[key] for errors in by_rank]
        )


def test_cp2_equals_sdpa():
    check_cp_attention(2)


@pytest.mark.slow
def test_cp4_equals_sdpa():
    check_cp_attention(4)


def test_one_process_equals_sdpa():
    """Without a group the op is plain (masked) attention: the document-masked single-rank path."""
    q, k, v, grad, ids = _inputs(8, 2, CASES["documents"][2])
    expected = _reference(q, k, v, grad, ids)
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    out = context_parallel_attention(q_, k_, v_, None, document_ids=ids)
    out.backward(grad)
    for got, want in zip((out, q_.grad, k_.grad, v_.grad), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_shard_then_unshard_is_identity_and_positions_restart():
    x = torch.arange(2 * 24).view(2, 24)
    shares = [shard_sequence(x, 3, r) for r in range(3)]
    assert shares[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    assert torch.equal(unshard_sequence(shares), x)
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert positions_within_documents(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 6"):
        shard_sequence(torch.zeros(1, 20), 3, 0)
