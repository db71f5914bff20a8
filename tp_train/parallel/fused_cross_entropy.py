"""The vocabulary-parallel head and its loss in one: the logits of a chunk of tokens are computed, reduced and
dropped, so the full logits never exist (Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy on one
device; here over a tensor-parallel group, the head split along the vocabulary as Megatron's)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.distributed import ProcessGroup
from torch.profiler import record_function

from tp_train.errors import HeadOutputChangedError
from tp_train.parallel.cross_entropy import (
    LossTargets,
    check_vocab_size,
    chunk_rows,
    chunk_statistics,
    empty_statistics,
    log_sum_exp_over_group,
    statistics_chunk,
)

# The profiler range in which backward allocates the gradients it returns (a measurement's marker: from its end on,
# those bytes are the returned gradients, not working memory).
RETURNED_GRADIENTS = "vocab_parallel_linear_cross_entropy: returned gradients"


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype the head's matmul runs in: autocast's, when it is on (as `F.linear` would), else the weight's."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class _VocabParallelLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, group, vocab_size, ignore_index, label_smoothing, chunk, dtype):
        targets = LossTargets.of(target, weight.size(0), group, vocab_size, ignore_index, label_smoothing)
        rows, valid, smoothing = hidden.size(0), targets.valid, label_smoothing > 0
        chunk = chunk_rows(rows, valid, chunk)
        head = weight[:valid].to(dtype)  # as autocast casts it for F.linear; the input is cast chunk by chunk
        row_max, sum_exp, sum_logits = empty_statistics(hidden.new_empty(0, dtype=dtype), rows, smoothing)
        target_logit = hidden.new_zeros(rows, dtype=row_max.dtype)
        for start in range(0, rows if valid else 0, chunk):
            part = slice(start, start + chunk)
            logits = statistics_chunk(hidden[part].to(dtype) @ head.T, writable=True)  # (chunk, valid): the only logits
            target_logit[part] = logits.gather(-1, targets.local_target[part].unsqueeze(-1)).squeeze(-1)
            row_max[part], sum_exp[part], chunk_sum = chunk_statistics(logits, smoothing)
            if smoothing:
                sum_logits[part] = chunk_sum
        target_logit.masked_fill_(~targets.in_range, 0.0)
        extra = [target_logit, sum_logits] if smoothing else [target_logit]
        log_sum_exp, summed = log_sum_exp_over_group(row_max, sum_exp, extra, group)
        ctx.save_for_backward(hidden, weight, log_sum_exp)
        ctx.targets, ctx.chunk, ctx.dtype = targets, chunk, dtype
        return targets.loss(log_sum_exp, summed[0], summed[1] if smoothing else None)

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, log_sum_exp = ctx.saved_tensors
        targets, chunk, dtype = ctx.targets, ctx.chunk, ctx.dtype
        valid = targets.valid
        row_scale = targets.row_scale(grad_output)
        head = weight[:valid].to(dtype)
        # The two gradients it returns, in their inputs' dtypes, made first: besides them and its inputs it holds
        # only the head in the compute dtype and one chunk's buffers (tools/bench/fused_memory.py measures that).
        with record_function(RETURNED_GRADIENTS):
            grad_hidden = (torch.empty_like if valid else torch.zeros_like)(hidden)
            grad_weight = torch.zeros_like(weight)  # padding rows of the vocabulary stay zero
        for start in range(0, hidden.size(0) if valid else 0, chunk):
            part = slice(start, start + chunk)
            inputs = hidden[part].to(dtype)
            logits = statistics_chunk(inputs @ head.T, writable=True)
            grad = targets.chunk_gradient(logits, log_sum_exp, row_scale, part).to(dtype)  # d loss / d logits
            grad_hidden[part] = grad @ head  # cast into the input's dtype as it is written
            grad_weight[:valid] += grad.T @ inputs  # accumulated in the weight's dtype
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` (a vocabulary-parallel head without bias) against `target`, computed
    chunk by chunk of tokens: equals `vocab_parallel_cross_entropy` of the head's logits, float32 (float64 for float64
    ones), while only one chunk's logits exist at a time, in forward and in backward (which recomputes them). Under
    autocast the matmuls run in its dtype, as the head's would.

    Args:
        hidden: (..., H) the head's input, replicated over the group and already in the parallel region (after
            `copy_to_tensor_parallel_region`, whose backward sums the ranks' partial input gradients).
        weight: (V_padded / tp, H) this rank's rows of the head's weight, padding rows past `vocab_size` included
            (their gradient is zero).
        target, group, vocab_size, ignore_index, label_smoothing: as `vocab_parallel_cross_entropy`.
        chunk_size: tokens per chunk; by default as many as fit 32 MiB of fp32 logits (all of them under compile).
    """
    check_vocab_size(weight.size(0), vocab_size, group)
    return _VocabParallelLinearCrossEntropy.apply(
        hidden.flatten(0, -2),
        weight,
        target.flatten(),
        group,
        vocab_size,
        ignore_index,
        label_smoothing,
        chunk_size,
        _compute_dtype(weight),
    )


class HeadLossFusion:
    """Joins a vocabulary-parallel head to the loss: while `deferring`, the head hands its input over (`hold`)
    instead of computing logits, and the loss that receives that same tensor computes head and loss together
    (`take`). Set on the head by `parallelize` (its `loss_fusion` setting); the caller that knows the head's output
    feeds only the loss (the strategy's training and validation steps) turns it on."""

    def __init__(self) -> None:
        self.active = False
        self._held: tuple[torch.Tensor, torch.nn.Module] | None = None

    @contextmanager
    def deferring(self):
        self.active, self._held = True, None
        try:
            yield self
        finally:
            self.active, self._held = False, None

    def hold(self, hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        """What the head returns while deferring: its input (in the parallel region), kept for the loss."""
        self._held = (hidden, head)
        return hidden

    def take(self, output: torch.Tensor) -> tuple[torch.Tensor, torch.nn.Module] | None:
        """(The head's input, the head) when `output` is what the head returned, None when the head did not run."""
        if self._held is None:
            return None
        hidden, head = self._held
        self._held = None
        if output is not hidden:
            raise HeadOutputChangedError(
                f"fused head and loss: the model changed its head's output {tuple(hidden.shape)} before the loss "
                f"(got {tuple(output.shape)}, {output.dtype}); pass fused_loss=False to compute the logits"
            )
        return hidden, head
