"""Cross-entropy over logits that are sharded along the vocabulary (Megatron-LM's vocab-parallel loss), computed
in chunks of tokens so that no full-size fp32 copy of the logits ever exists. "fp32" below is `statistics_dtype`:
float64 for float64 logits (precision=64)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel import invariant
from tp_train.parallel.collectives import all_reduce
from tp_train.parallel.sharding import section_slice
from tp_train.parallel.widening import statistics_dtype, widened

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


def statistics_chunk(chunk: torch.Tensor, writable: bool) -> torch.Tensor:
    """`chunk` in fp32 (fp64 if it is), free to overwrite: a copy, or `chunk` itself when it is already in that
    dtype and `writable`."""
    if chunk.dtype != statistics_dtype(chunk.dtype):
        return widened(chunk)
    return chunk if writable else chunk.clone()


def chunk_statistics(part: torch.Tensor, smoothing: bool):
    """Per row of one fp32 chunk of logits (rows, real columns): (max, sum of exp(logit - max), sum of the logits if
    `smoothing` else None)."""
    part_max = part.max(dim=-1).values
    sum_logits = part.sum(dim=-1) if smoothing else None
    return part_max, (part - part_max.unsqueeze(-1)).exp_().sum(dim=-1), sum_logits


def empty_statistics(logits: torch.Tensor, rows: int, smoothing: bool):
    """Per-token (max, sum of exps, sum of logits) buffers in fp32 (fp64 for fp64 logits), as a shard of no real
    column leaves them."""
    dtype = statistics_dtype(logits.dtype)
    row_max = logits.new_full((rows,), float("-inf"), dtype=dtype)
    sum_logits = logits.new_zeros((rows,), dtype=dtype) if smoothing else None
    return row_max, logits.new_zeros((rows,), dtype=dtype), sum_logits


def log_sum_exp_over_group(row_max, sum_exp, extra: list[torch.Tensor], group: ProcessGroup):
    """(log-sum-exp over the whole vocabulary per token, `extra` summed over the group): each rank's sum of exps is
    rescaled to the group's max, so the ranks exchange one max and one stacked sum (two all-reduces)."""
    if dist.get_world_size(group) == 1:
        return row_max + sum_exp.log(), extra
    global_max = all_reduce(row_max.clone(), group, "max")
    scaled = sum_exp * (row_max - global_max).exp()  # a shard of no real column: exp(-inf) * 0 = 0
    summed = all_reduce(torch.stack([scaled, *extra]), group)
    return global_max + summed[0].log(), list(summed[1:])


@dataclass(frozen=True)
class LossTargets:
    """What the loss knows of each token's target on this rank, from forward to backward."""

    local_target: torch.Tensor  # the target's column in this shard (0 where it is elsewhere)
    in_range: torch.Tensor  # whether this shard holds the target
    keep: torch.Tensor  # whether the target counts (not ignore_index)
    vocab_start: int  # this shard's first column in the vocabulary
    valid: int  # this shard's real (not padding) columns
    vocab_size: int
    label_smoothing: float

    @staticmethod
    def of(target, logits_width: int, group: ProcessGroup, vocab_size, ignore_index, label_smoothing) -> LossTargets:
        columns = section_slice(vocab_size, logits_width, dist.get_rank(group))  # the rest of the shard is padding
        start, valid = columns.start, columns.real
        in_range = (target >= start) & (target < start + valid)
        local_target = (target - start).masked_fill(~in_range, 0)
        keep = target != ignore_index
        return LossTargets(local_target, in_range, keep, start, valid, vocab_size, label_smoothing)

    def loss(self, log_sum_exp, target_logit, sum_logits) -> torch.Tensor:
        """The mean over kept tokens of -log p(target), smoothed as `F.cross_entropy` (nan when none is kept)."""
        loss = log_sum_exp - target_logit
        eps = self.label_smoothing
        if eps > 0:  # (1 - eps) * nll + eps * mean over the vocabulary of -log p(j)
            loss = (1 - eps) * loss + eps * (log_sum_exp - sum_logits / self.vocab_size)
        return (loss * self.keep).sum() / self.keep.sum()

    def row_scale(self, grad_output) -> torch.Tensor:
        """d loss / d (token i's loss term): grad_output / count for kept tokens, 0 for ignored ones."""
        dtype = statistics_dtype(grad_output.dtype)
        return self.keep.to(dtype) * (grad_output.to(dtype) / self.keep.sum())

    def chunk_gradient(self, part, log_sum_exp, row_scale, rows: slice) -> torch.Tensor:
        """d loss / d logits of one fp32 chunk (rows, real columns), in place of `part`:
        row_scale_i * (p_ij - (1 - eps) [j == target_i] - eps / V)."""
        grad = part.sub_(log_sum_exp[rows].unsqueeze(-1)).exp_()  # the softmax
        eps = self.label_smoothing
        if eps > 0:
            grad -= eps / self.vocab_size
        picked = torch.arange(grad.size(0), device=grad.device), self.local_target[rows]
        grad[picked] -= (1 - eps) * self.in_range[rows].to(grad.dtype)
        return grad.mul_(row_scale[rows].unsqueeze(-1))


def check_vocab_size(local_width: int, vocab_size: int, group: ProcessGroup) -> None:
    """Raises one line unless `vocab_size` fits a vocabulary held `local_width` per rank over the group, as padded."""
    world_size = dist.get_world_size(group)
    if not local_width * world_size - local_width < vocab_size <= local_width * world_size:
        raise ValueError(
            f"vocab_size={vocab_size} does not fit logits sharded {local_width} wide over {world_size} ranks; "
            f"pass the model's real vocabulary size"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, ignore_index, label_smoothing, chunk, in_place, numerics):
        targets = LossTargets.of(target, logits.size(-1), group, vocab_size, ignore_index, label_smoothing)
        rows, valid, smoothing = logits.size(0), targets.valid, label_smoothing > 0
        chunk = chunk_rows(rows, valid, chunk)
        dtype = statistics_dtype(logits.dtype)
        target_logit = logits.gather(-1, targets.local_target.unsqueeze(-1)).squeeze(-1).to(dtype)
        target_logit = target_logit.masked_fill(~targets.in_range, 0.0)
        if numerics == invariant.INVARIANT:
            log_sum_exp, summed = _invariant_log_sum_exp(logits, target_logit, chunk, smoothing, group, vocab_size)
            ctx.save_for_backward(logits, log_sum_exp)
            ctx.targets, ctx.chunk, ctx.in_place = targets, chunk, in_place
            return targets.loss(log_sum_exp, summed[0], summed[1] if smoothing else None)
        row_max, sum_exp, sum_logits = empty_statistics(logits, rows, smoothing)
        for start in range(0, rows if valid else 0, chunk):
            part = slice(start, start + chunk)
            # (chunk, valid) fp32: the only copy of the logits' values
            row_max[part], sum_exp[part], chunk_sum = chunk_statistics(logits[part, :valid].to(dtype), smoothing)
            if smoothing:
                sum_logits[part] = chunk_sum
        extra = [target_logit, sum_logits] if smoothing else [target_logit]
        log_sum_exp, summed = log_sum_exp_over_group(row_max, sum_exp, extra, group)
        # The logits themselves (their own dtype) and one fp32 number per token: backward recomputes the softmax.
        ctx.save_for_backward(logits, log_sum_exp)
        ctx.targets, ctx.chunk, ctx.in_place = targets, chunk, in_place
        return targets.loss(log_sum_exp, summed[0], summed[1] if smoothing else None)

    @staticmethod
    def backward(ctx, grad_output):
        logits, log_sum_exp = ctx.saved_tensors
        targets, chunk = ctx.targets, ctx.chunk
        row_scale = targets.row_scale(grad_output)
        out = logits if ctx.in_place else torch.empty_like(logits)
        if targets.valid < logits.size(-1):
            out[:, targets.valid :] = 0  # padding columns never entered the softmax
        for start in range(0, logits.size(0) if targets.valid else 0, chunk):
            rows = slice(start, start + chunk)
            part = statistics_chunk(logits[rows, : targets.valid], writable=ctx.in_place)
            out[rows, : targets.valid] = targets.chunk_gradient(part, log_sum_exp, row_scale, rows)
        return out, None, None, None, None, None, None, None, None


def _invariant_log_sum_exp(logits, target_logit, chunk: int, smoothing: bool, group: ProcessGroup, vocab_size: int):
    """`log_sum_exp_over_group` in `numerics="invariant"`'s order: the group's max first (a max is exact in any
    order), then each shard's exps summed in leaves (`invariant.row_sum`) and the shards' sums finished in the tree
    (`invariant.finish_sum`); the target logit (one shard's, zeros elsewhere: exact) all-reduced."""
    dtype = statistics_dtype(logits.dtype)
    row_max = logits.max(dim=-1).values.to(dtype)
    global_max = all_reduce(row_max, group, "max")
    sum_exp = torch.empty_like(global_max)
    sum_logits = torch.empty_like(global_max) if smoothing else None
    for start in range(0, logits.size(0), chunk):
        part = slice(start, start + chunk)
        values = logits[part].to(dtype)
        if smoothing:
            sum_logits[part] = invariant.row_sum(values, vocab_size)
        sum_exp[part] = invariant.row_sum((values - global_max[part].unsqueeze(-1)).exp_(), vocab_size)
    sum_exp = invariant.finish_sum(sum_exp, group)
    summed = [all_reduce(target_logit, group)]
    if smoothing:
        summed.append(invariant.finish_sum(sum_logits, group))
    return global_max + sum_exp.log(), summed


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group: ProcessGroup,
    vocab_size: int,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    in_place_backward: bool = False,
    chunk_size: int | None = None,
    numerics: str = invariant.FAST,
) -> torch.Tensor:
    """Mean cross-entropy of vocab-sharded logits; equals `F.cross_entropy` on the gathered logits, and is float32
    whatever the logits' dtype (as `F.cross_entropy` under autocast), float64 for float64 logits.

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
        numerics: "invariant" sums over the vocabulary in one fixed order (`tp_train.parallel.invariant`): the same
            bits at every tensor-parallel degree; a vocabulary split over ranks must then be a multiple of 8.
    """
    check_vocab_size(logits.size(-1), vocab_size, group)
    if invariant.check_numerics(numerics, "vocab_parallel_cross_entropy") == invariant.INVARIANT:
        invariant.check_split(vocab_size, dist.get_world_size(group), "vocab_parallel_cross_entropy's vocabulary")
    return _VocabParallelCrossEntropy.apply(
        logits.flatten(0, -2),
        target.flatten(),
        group,
        vocab_size,
        ignore_index,
        label_smoothing,
        chunk_size,
        in_place_backward,
        numerics,
    )
