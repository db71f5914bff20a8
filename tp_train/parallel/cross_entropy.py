"""Cross-entropy over logits that are sharded along the vocabulary (Megatron-LM's vocab-parallel loss), computed
in chunks of tokens so that no full-size fp32 copy of the logits ever exists."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_reduce
from tp_train.parallel.sharding import section_slice

# fp32 bytes of logits one chunk turns into at once (the chunk's rows are this over the shard's width): small
# beside bf16 logits of a real vocabulary (8 x 1024 tokens x 50,304 columns x 2 bytes = 786 MiB), large enough
# that a chunk's kernels stay efficient.
CHUNK_BYTES = 32 * 2**20


def chunk_rows(rows: int, columns: int, chunk: int | None = None) -> int:
    """Tokens per chunk: `chunk` if given, else as many as fit CHUNK_BYTES of fp32 (all of them when compiling:
    inductor fuses the reductions without materialising the fp32 copy)."""
    if chunk is not None:
        return max(1, chunk)
    if torch.compiler.is_compiling():
        return max(1, rows)
    return max(1, CHUNK_BYTES // (4 * max(1, columns)))


def token_statistics(logits: torch.Tensor, valid: int, chunk: int, smoothing: bool):
    """Per token of `logits` (N, V_local), over its first `valid` columns, in fp32 chunk by chunk: (row max, sum of
    exp(logit - row max), sum of the logits if `smoothing` else None). A shard with no real column gives -inf, 0, 0."""
    rows = logits.size(0)
    row_max = logits.new_full((rows,), float("-inf"), dtype=torch.float32)
    sum_exp = logits.new_zeros((rows,), dtype=torch.float32)
    sum_logits = logits.new_zeros((rows,), dtype=torch.float32) if smoothing else None
    if valid == 0:
        return row_max, sum_exp, sum_logits
    for start in range(0, rows, chunk):
        part = logits[start : start + chunk, :valid].float()  # (chunk, valid) fp32: the only copy
        part_max = part.max(dim=-1).values
        row_max[start : start + chunk] = part_max
        if sum_logits is not None:
            sum_logits[start : start + chunk] = part.sum(dim=-1)
        sum_exp[start : start + chunk] = (part - part_max.unsqueeze(-1)).exp_().sum(dim=-1)
    return row_max, sum_exp, sum_logits


def log_sum_exp_over_group(row_max, sum_exp, extra: list[torch.Tensor], group: ProcessGroup):
    """(log-sum-exp over the whole vocabulary per token, `extra` summed over the group): each rank's sum of exps is
    rescaled to the group's max, so the ranks exchange one max and one stacked sum (two all-reduces)."""
    if dist.get_world_size(group) == 1:
        return row_max + sum_exp.log(), extra
    global_max = all_reduce(row_max.clone(), group, "max")
    scaled = sum_exp * (row_max - global_max).exp()  # a shard of no real column: exp(-inf) * 0 = 0
    summed = all_reduce(torch.stack([scaled, *extra]), group)
    return global_max + summed[0].log(), list(summed[1:])


def logits_gradient(
    logits, out, log_sum_exp, local_target, in_range, row_scale, valid: int, label_smoothing: float, vocab_size: int,
    chunk: int,
) -> torch.Tensor:  # fmt: skip
    """Writes d loss / d logits into `out` (N, V_local; may be `logits` itself) chunk by chunk, in fp32 per chunk:
    row_scale_i * (p_ij - (1 - eps) [j == target_i] - eps / V), zero on padding columns."""
    rows = logits.size(0)
    if valid < logits.size(-1):
        out[:, valid:] = 0
    if valid == 0:
        return out
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        grad = (logits[start:stop, :valid].float() - log_sum_exp[start:stop].unsqueeze(-1)).exp_()  # softmax
        if label_smoothing > 0:
            grad -= label_smoothing / vocab_size
        picked = torch.arange(stop - start, device=grad.device), local_target[start:stop]
        grad[picked] -= (1 - label_smoothing) * in_range[start:stop].to(grad.dtype)
        grad *= row_scale[start:stop].unsqueeze(-1)
        out[start:stop, :valid] = grad
    return out


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, label_smoothing, chunk, in_place):
        # This rank's columns of the vocabulary; those past the real vocabulary are padding.
        columns = section_slice(vocab_size, logits.size(-1), dist.get_rank(group))
        vocab_start, valid = columns.start, columns.real
        chunk = chunk_rows(logits.size(0), valid, chunk)

        in_range = (target >= vocab_start) & (target < vocab_start + valid)
        local_target = (target - vocab_start).masked_fill(~in_range, 0)
        target_logit = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).float().masked_fill(~in_range, 0.0)
        smoothing = label_smoothing > 0
        row_max, sum_exp, sum_logits = token_statistics(logits, valid, chunk, smoothing)
        log_sum_exp, summed = log_sum_exp_over_group(
            row_max, sum_exp, [target_logit, sum_logits] if smoothing else [target_logit], group
        )
        loss = log_sum_exp - summed[0]  # -log p(target)
        if smoothing:
            # F.cross_entropy's smoothing: (1 - eps) * nll + eps * mean over the vocab of -log p(j).
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_sum_exp - summed[1] / vocab_size)

        keep = target != ignore_index
        count = keep.sum()
        loss = (loss * keep).sum() / count  # nan when every target is ignored, as F.cross_entropy

        # The logits themselves (their own dtype) and one fp32 number per token: backward recomputes the softmax.
        ctx.save_for_backward(logits, log_sum_exp, local_target, in_range, keep, count)
        ctx.settings = valid, label_smoothing, vocab_size, chunk, in_place
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        logits, log_sum_exp, local_target, in_range, keep, count = ctx.saved_tensors
        valid, label_smoothing, vocab_size, chunk, in_place = ctx.settings
        row_scale = keep.to(torch.float32) * (grad_output.float() / count)
        out = logits if in_place else torch.empty_like(logits)
        grad = logits_gradient(
            logits, out, log_sum_exp, local_target, in_range, row_scale, valid, label_smoothing, vocab_size, chunk
        )
        return grad, None, None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    in_place_backward: bool = False,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits; equals `F.cross_entropy` on the gathered logits, and is float32
    whatever the logits' dtype (as `F.cross_entropy` under autocast).

    The logits stay in their dtype: the row max, the sum of exps and the target logit are computed in fp32 over
    chunks of tokens, so the loss holds one chunk's fp32 copy at a time and saves only the logits and one fp32
    log-sum-exp per token for backward. Across the group, one max and one stacked sum are all-reduced per call.

    Args:
        logits: (..., V_padded / tp), this rank's contiguous slice of the (padded) vocabulary, as produced by a
            `ColumnParallelLinear` head without `gather_output`.
        target: (...) token ids in [0, vocab_size), or `ignore_index`.
        group: the tensor-parallel process group the logits are sharded over.
        vocab_size: the real vocabulary size. Required: `parallelize` pads the vocabulary to a multiple of tp, and
            padding columns must not enter the softmax.
        ignore_index: targets with this value do not count towards the mean.
        label_smoothing: as in `F.cross_entropy`.
        in_place_backward: write the logits' gradient into the logits' own buffer in backward (no second
            logits-sized buffer). Only when nothing reads the logits after backward; the strategy's loss does this.
        chunk_size: tokens per fp32 chunk; by default as many as fit 32 MiB of fp32 (all of them under compile).
    """
    width = logits.size(-1) * dist.get_world_size(group)
    if not width - logits.size(-1) < vocab_size <= width:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit logits sharded {logits.size(-1)} wide over "
            f"{dist.get_world_size(group)} ranks; pass the model's real vocabulary size"
        )
    return _VocabParallelCrossEntropy.apply(
        logits.flatten(0, -2),
        target.flatten(),
        group,
        vocab_size,
        ignore_index,
        label_smoothing,
        chunk_size,
        in_place_backward,
    )
