"""Cross-entropy over logits that are sharded along the vocabulary (Megatron-LM's vocab-parallel loss)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import all_reduce
from tp_train.parallel.sharding import section_slice


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, label_smoothing):
        rank = dist.get_rank(group)
        # This rank's columns of the vocabulary; those past the real vocabulary are padding.
        columns = section_slice(vocab_size, logits.size(-1), rank)
        vocab_start, valid_columns = columns.start, columns.real
        logits = logits.float()

        max_logits = (
            logits[:, :valid_columns].max(dim=-1).values
            if valid_columns
            else logits.new_full((logits.size(0),), float("-inf"))
        )
        max_logits = all_reduce(max_logits, group, "max")
        shifted = logits - max_logits.unsqueeze(-1)
        shifted[:, valid_columns:] = float("-inf")

        in_range = (target >= vocab_start) & (target < vocab_start + valid_columns)
        local_target = (target - vocab_start).masked_fill(~in_range, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        exp = shifted.exp()
        # One all-reduce for the three per-token sums.
        stats = torch.stack([target_logit, exp.sum(dim=-1), shifted[:, :valid_columns].sum(dim=-1)])
        stats = all_reduce(stats, group)
        target_logit, sum_exp, sum_logits = stats

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit  # -log p(target)
        if label_smoothing > 0:
            # F.cross_entropy's smoothing: (1 - eps) * nll + eps * mean over the vocab of -log p(j).
            loss = (1 - label_smoothing) * loss + label_smoothing * (log_sum_exp - sum_logits / vocab_size)

        keep = target != ignore_index
        count = keep.sum()
        loss = (loss * keep).sum() / count  # nan when every target is ignored, as F.cross_entropy

        softmax = exp / sum_exp.unsqueeze(-1)
        ctx.save_for_backward(softmax, local_target, in_range, keep, count)
        ctx.label_smoothing, ctx.valid_columns, ctx.vocab_size = label_smoothing, valid_columns, vocab_size
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, local_target, in_range, keep, count = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # d loss_i / d logit_j = p_j - (1 - eps) [j == target] - eps / V
        rows = torch.arange(grad.size(0), device=grad.device)
        grad[rows, local_target] -= (1 - eps) * in_range.to(grad.dtype)
        if eps > 0:
            grad[:, : ctx.valid_columns] -= eps / ctx.vocab_size
        grad *= (keep.to(grad.dtype) * grad_output / count).unsqueeze(-1)
        return grad, None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits; equals `F.cross_entropy` on the gathered logits.

    Args:
        logits: (..., V_padded / tp), this rank's contiguous slice of the (padded) vocabulary, as produced by a
            `ColumnParallelLinear` head without `gather_output`.
        target: (...) token ids in [0, vocab_size), or `ignore_index`.
        group: the tensor-parallel process group the logits are sharded over.
        vocab_size: the real vocabulary size. Required: `parallelize` pads the vocabulary to a multiple of tp, and
            padding columns must not enter the softmax.
        ignore_index: targets with this value do not count towards the mean.
        label_smoothing: as in `F.cross_entropy`.
    """
    width = logits.size(-1) * dist.get_world_size(group)
    if not width - logits.size(-1) < vocab_size <= width:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit logits sharded {logits.size(-1)} wide over "
            f"{dist.get_world_size(group)} ranks; pass the model's real vocabulary size"
        )
    out_dtype = logits.dtype
    loss = _VocabParallelCrossEntropy.apply(
        logits.flatten(0, -2), target.flatten(), group, vocab_size, ignore_index, label_smoothing
    )
    return loss.to(out_dtype)
