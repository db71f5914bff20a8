"""Sums in one fixed order, whatever the layout (`numerics="invariant"`; docs/invariant-numerics.md).

A sum whose terms a layout splits across ranks (a row-parallel matmul's contraction, a column-parallel layer's input
gradient, the vocabulary-parallel softmax's denominator, the clipping norm) is computed here in an order that depends
only on the global problem, so the unsharded model and every tensor-parallel degree produce the same bits:

- a dimension of global size D is cut into `LEAVES` equal leaves when it is contracted, and into tiles of
  `tile(D)` (a power of two up to `MAX_TILE` dividing D / `MAX_SPLIT`) when it is not; a rank holding 1 / tp of the
  dimension (tp a power of two up to `MAX_SPLIT`) holds whole leaves and whole tiles;
- a matrix product is, for each tile of its output's columns, one batched matmul over the leaves, every product of
  one shape (all the rows, a leaf, a tile): a product depends only on its inputs (not on how many leaves the batch
  holds, nor on the columns beside it; `tests/test_invariant_numerics.py` checks this on this machine). The rows
  are whole: every tensor-parallel rank holds all of a leaf's tokens (`tp_train.training.leaves`);
- the leaves are summed in one tree, halving: leaves [0, n) are the tree of [0, n // 2) plus the tree of
  [n // 2, n). A rank's share of the leaves is a whole subtree: it sums its own, gathers the other ranks' subtree
  sums, and finishes the tree over them (an all-gather and a fixed-order local sum, where an all-reduce's order is
  not defined);
- a plain sum over a dimension (no product) adds within each leaf by halving too, element-wise (exact rounding, the
  same bits on any kernel), zeros padding a leaf to a power of two.

A product materialises one column tile's partial products at a time (`LEAVES` times the tile), and the mode runs one
thread per process (a CPU kernel's own reductions, LayerNorm's, may follow its threads). Its cost is in
docs/invariant-numerics.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.agreement import before_collective
from tp_train.parallel.collectives import all_gather_single

MAX_SPLIT = 8  # the most ranks one dimension may be split over
LEAVES = 8  # a contracted dimension's leaves, each one block product (or one element-wise sum)
MAX_TILE = 128  # the largest tile of a dimension that is not contracted
FAST, INVARIANT = "fast", "invariant"
NUMERICS = (FAST, INVARIANT)


def check_numerics(numerics: str, where: str) -> str:
    if numerics not in NUMERICS:
        raise ValueError(f"{where}: numerics={numerics!r}; use one of {', '.join(NUMERICS)}")
    return numerics


def check_split(size: int, ranks: int, where: str) -> None:
    """A dimension of global `size` split over `ranks` must give each rank whole leaves and whole tiles."""
    if ranks & (ranks - 1) or ranks > MAX_SPLIT:
        raise ValueError(
            f"{where}: numerics='invariant' splits a dimension over 1, 2, 4 or {MAX_SPLIT} ranks; got {ranks}"
        )
    if ranks > 1 and size % MAX_SPLIT:
        raise ValueError(
            f"{where}: numerics='invariant' splits a dimension only when its size is a multiple of {MAX_SPLIT}; "
            f"{size} is not"
        )


def tile(size: int) -> int:
    """The tile of a dimension of global `size`: the largest power of two up to MAX_TILE dividing size / MAX_SPLIT
    (1 where size is no multiple of MAX_SPLIT: such a dimension is never split)."""
    share = size // MAX_SPLIT if size % MAX_SPLIT == 0 else 1
    return min(MAX_TILE, share & -share) if share else 1


def leaf(size: int) -> int:
    """The leaf of a contracted dimension of global `size`: size / LEAVES, or all of it where LEAVES does not
    divide it (such a dimension is never split)."""
    return size // LEAVES if size % LEAVES == 0 else size


def tree_sum(parts: torch.Tensor) -> torch.Tensor:
    """The sum over dim 0 of `parts`, halving: parts[:n // 2] and parts[n // 2:] summed apart, then added."""
    count = parts.size(0)
    if count == 1:
        return parts[0]
    half = count // 2
    return tree_sum(parts[:half]) + tree_sum(parts[half:])


def matmul(a: torch.Tensor, b: torch.Tensor, sizes: tuple[int, int, int]) -> torch.Tensor:
    """`a @ b` for 2-D `a` (M, K) and `b` (K, N), this rank's parts of a product of global `sizes` (M, K, N): K in
    `leaf(K)` leaves summed by `tree_sum` (a split K: this rank's subtree), N in `tile(N)` tiles, every tile's leaves
    one batched matmul of the same shape (M rows: every tensor-parallel rank holds all of them). Zeros pad the last
    tile."""
    m, k = a.shape
    n = b.size(1)
    inner, columns = leaf(sizes[1]), tile(sizes[2])
    if k % inner:
        raise ValueError(f"invariant.matmul: {k} contracted elements are not whole leaves of {inner} (of {sizes[1]})")
    leaves = k // inner
    width = -(-n // columns) * columns
    left = a.reshape(m, leaves, inner).transpose(0, 1).contiguous()  # (leaves, M, inner)
    right = F.pad(b, (0, width - n)).reshape(leaves, inner, width // columns, columns).permute(2, 0, 1, 3).contiguous()
    partial = a.new_empty((leaves, m, columns))
    out = a.new_empty((width // columns, m, columns))
    for j in range(width // columns):
        out[j] = tree_sum(torch.bmm(left, right[j], out=partial))
    return out.transpose(0, 1).reshape(m, width)[:, :n]


def _halving(x: torch.Tensor) -> torch.Tensor:
    """The sum over the last dimension, halving element-wise (zeros padding it to a power of two)."""
    width = x.size(-1)
    x = F.pad(x, (0, (1 << (width - 1).bit_length()) - width))
    while x.size(-1) > 1:
        half = x.size(-1) // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def row_sum(x: torch.Tensor, size: int) -> torch.Tensor:
    """The sum of each row of 2-D `x`, this rank's columns of rows of global width `size`: each `leaf(size)` leaf
    by `_halving`, the leaves by `tree_sum` (a split width: this rank's subtree)."""
    width = leaf(size)
    leaves = x.reshape(x.size(0), -1, width)
    return tree_sum(_halving(leaves).t())


def column_sum(x: torch.Tensor, size: int) -> torch.Tensor:
    """The sum of each column of 2-D `x`, this rank's rows of a global `size` rows (`row_sum`'s order)."""
    return row_sum(x.t(), size)


def finish_sum(partial: torch.Tensor, group: ProcessGroup | None, order: list[int] | None = None) -> torch.Tensor:
    """The whole tree's sum from each rank's subtree sum `partial` (rank r holding the r-th of the group's equal,
    consecutive shares of the leaves, or the `order.index(r)`-th): all-gathered, then summed by `tree_sum`."""
    ranks = 1 if group is None else group.size()
    if ranks == 1:
        return partial
    flat = partial.contiguous().reshape(1, -1)
    gathered = flat.new_empty((ranks, flat.size(1)))
    before_collective()
    all_gather_single(gathered, flat, group=group)
    if order is not None:
        gathered = gathered[order]
    return tree_sum(gathered.reshape(ranks, *partial.shape))


class InvariantLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` in tiles, for a layer whose weight is one rank's shard: with `contracted_group`
    the layer's input features are split over it (row-parallel: the forward's sum is finished over the group), with
    `output_group` its output features are (column-parallel: the input gradient's sum is). Without either, the
    unsharded layer in the same order.

    Under autocast (bf16-mixed, 16-mixed) the inputs and weight are rounded to its dtype, as its matmul would take
    them, and the products and their tree run in float32 (exact products of half-precision numbers, no partial
    sum rounded to half precision); the output is rounded to the autocast dtype once, at the end. The gradients of
    the input, weight and bias come back in their own dtypes (float32 under mixed precision)."""

    @staticmethod
    def forward(ctx, x, weight, bias, contracted_group, output_group):
        low = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else None
        ctx.low, ctx.dtypes = low, (x.dtype, bias.dtype if bias is not None else None)
        ctx.has_bias, ctx.output_group, ctx.contracted_group = bias is not None, output_group, contracted_group
        with torch.autocast(x.device.type, enabled=False):
            x_, weight_ = _rounded(x, low), _rounded(weight, low)
            ctx.save_for_backward(x_, weight_)
            flat = x_.reshape(-1, x_.size(-1))
            # the global sizes, which fix the leaves and tiles: tokens, input features, output features
            ctx.sizes = (flat.size(0), weight.size(1) * _ranks(contracted_group), weight.size(0) * _ranks(output_group))
            tokens, inputs, outputs = ctx.sizes
            y = finish_sum(matmul(flat, weight_.t(), (tokens, inputs, outputs)), contracted_group)
            if bias is not None:
                y = y + _rounded(bias, low)
            return y.reshape(*x.shape[:-1], weight.size(0)).to(low or y.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        tokens, inputs, outputs = ctx.sizes
        with torch.autocast(grad_output.device.type, enabled=False):
            flat = x.reshape(-1, x.size(-1))
            grad = grad_output.reshape(-1, grad_output.size(-1)).to(x.dtype)
            grad_x = finish_sum(matmul(grad, weight, (tokens, outputs, inputs)), ctx.output_group).reshape(x.shape)
            grad_weight = matmul(grad.t(), flat, (outputs, tokens, inputs)).to(weight.dtype)
            grad_bias = column_sum(grad, tokens).to(ctx.dtypes[1]) if ctx.has_bias else None
            return grad_x.to(ctx.dtypes[0]), grad_weight, grad_bias, None, None


def _rounded(t: torch.Tensor, low: torch.dtype | None) -> torch.Tensor:
    """`t` rounded to `low` (autocast's dtype) and back to float32, exactly representable; `t` itself without it."""
    return t.to(low).float() if low is not None else t


def _ranks(group: ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def linear(x, weight, bias=None, contracted_group=None, output_group=None) -> torch.Tensor:
    """`InvariantLinear` (see it); the groups of size one are dropped."""
    return InvariantLinear.apply(x, weight, bias, contracted_group, output_group)
