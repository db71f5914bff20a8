"""One block of attention on torch's fused kernels, returning the log-sum-exp a ring needs to merge blocks, and its
backward from the merged output and log-sum-exp: nothing of size (queries x keys) is ever allocated.

The kernel is picked by the tensors' device: on CPU, `_scaled_dot_product_flash_attention_for_cpu` (grouped-query
attention without repeating keys and values); on CUDA, the memory-efficient kernel (fp32, fp16 and bf16; its keys
and values are repeated per query head for grouped-query attention). Blocks are merged in fp32 (fp64 for fp64 inputs)
whatever the inputs' dtype, as in ring-flash-attention and TransformerEngine's context parallelism.
"""

from __future__ import annotations

import torch

from tp_train.parallel.widening import widened

_LSE_ALIGNMENT = 32  # the CUDA memory-efficient kernel pads its log-sum-exp's query dim to a multiple of this


def block_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale) v of one block and its log-sum-exp.

    Args:
        q: (B, Hq, Tq, D) queries; k, v: (B, Hkv, Tk, D) keys and values, Hkv dividing Hq (any strides with a
            unit last stride).
        causal: query i sees keys 0..i (top-left aligned; the callers use it only on square diagonal blocks).
        scale: the score scale.

    Returns:
        (B, Hq, Tq, D) output in q's dtype, and (B, Hq, Tq) fp32 log-sum-exp of each query's scaled scores.
    """
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, widened(lse)
    groups = q.shape[1] // k.shape[1]
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, _repeat_heads(k, groups), _repeat_heads(v, groups), None, True, 0.0, causal, scale=scale
    )
    return out, widened(lse[..., : q.shape[2]])


def block_backward(grad_out, q, k, v, out, lse, causal: bool, scale: float):
    """Gradients of one block's q, k, v given the whole row's (merged) output and log-sum-exp: the kernel recomputes
    each probability as exp(score - lse), which is its share of the softmax over every block, and corrects with
    rowsum(grad_out * out) of the merged output, so summing the blocks' gradients gives the whole attention's.

    Args:
        grad_out, out: (B, Hq, Tq, D) the gradient of the merged output and the merged output, in q's dtype.
        q, k, v: as in `block_forward`.
        lse: (B, Hq, Tq) fp32 merged log-sum-exp.
        causal, scale: as in `block_forward`.

    Returns:
        (grad_q, grad_k, grad_v) in the inputs' dtype, grad_k and grad_v with Hkv heads.
    """
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    groups = q.shape[1] // k.shape[1]
    padded = torch.nn.functional.pad(lse, (0, -lse.shape[-1] % _LSE_ALIGNMENT))
    seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: the random state is never read
    grad_q, grad_k, grad_v, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, q, _repeat_heads(k, groups), _repeat_heads(v, groups), None, out, padded.contiguous(), seed, seed,
        0.0, [True, True, True, False], causal, scale=scale,
    )  # fmt: skip
    return grad_q, _sum_heads(grad_k, groups), _sum_heads(grad_v, groups)


def merge_block(out, lse, block_out, block_lse) -> None:
    """Merges one block's output and log-sum-exp into the running fp32 `out` and `lse` in place (rows seen by no
    block yet hold lse = -inf and out = 0); `block_out` is consumed (scaled in place when it is fp32):

        lse' = log(exp(lse) + exp(block_lse)),  out' = out * exp(lse - lse') + block_out * exp(block_lse - lse')
    """
    merged = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - merged).unsqueeze(-1))
    out.add_(widened(block_out).mul_(torch.exp(block_lse - merged).unsqueeze(-1)))  # no copy of an fp32 block
    lse.copy_(merged)


def _repeat_heads(x, groups):
    """(B, Hkv, T, D) -> (B, Hkv x groups, T, D): each key/value head once per query head that shares it."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_heads(grad, groups):
    """The inverse of `_repeat_heads` for gradients: (B, Hkv x groups, T, D) -> (B, Hkv, T, D)."""
    if groups == 1:
        return grad
    batch, heads, length, dim = grad.shape
    return grad.view(batch, heads // groups, groups, length, dim).sum(dim=2)
