"""A batch's backward in fixed token leaves (`numerics="invariant"` at any data-parallel size).

Under data parallelism every parameter's gradient is a sum over the batch's tokens split between ranks, and most of
those sums are not ours to order: autograd reduces a broadcast parameter (a norm's weight, a bias) over the tokens a
rank holds, in its kernel's order. So the order is fixed one level up. The global batch is cut into
`invariant.LEAVES` leaves of samples, leaf l holding the global batch's positions l, l + LEAVES, l + 2 LEAVES, ...;
each leaf's forward and backward runs alone, with the same shapes in every layout (a leaf is the same samples whatever
dp is), so its gradients have the same bits; and the leaves' gradients are added in `invariant.tree_sum`'s halving
tree, the leaves in the bit-reversed order of their index.

Data-parallel rank r of dp holds the positions r, r + dp, r + 2 dp, ... (Lightning's `DistributedSampler`), so the
leaves r, r + dp, ...: in bit-reversed order a consecutive run, a whole subtree (dp a power of two up to
`invariant.MAX_SPLIT`). The rank adds its own, then gathers the other ranks' subtree sums and finishes the tree
(`invariant.finish_sum`, the ranks in bit-reversed order too), in place of DDP's all-reduce. The loss of the batch is
summed the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel import invariant


def backward_in_leaves(
    parameters: list[nn.Parameter],
    inputs: torch.Tensor,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    replicas: ProcessGroup,
) -> torch.Tensor:
    """Sets each parameter's `.grad` to the gradient of the whole batch's mean loss, and returns that loss (detached,
    the same on every rank), summed in fixed leaves (module docstring).

    Args:
        parameters: the trainable parameters (this rank's shards).
        inputs: this data-parallel rank's share of the global batch's samples (dim 0): rank r of dp holds positions
            r, r + dp, r + 2 dp, ... of the global batch, as Lightning's `DistributedSampler` deals them.
        loss_of: `loss_of(samples)` -> the mean loss over those samples' tokens, with its graph (the forward run
            inside). Every leaf has as many tokens counted (no ignored targets), so a leaf's mean is its share of the
            batch's mean times LEAVES.
        replicas: the ranks holding the other shares (`mesh.replicas`).
    """
    ranks = dist.get_world_size(replicas)
    invariant.check_split(inputs.size(0) * ranks, ranks, "backward_in_leaves' global batch")
    local = invariant.LEAVES // ranks
    if inputs.size(0) % local:
        raise ValueError(
            f"backward_in_leaves: {inputs.size(0)} samples a rank do not cut into its {local} leaves of the global "
            f"batch ({invariant.LEAVES} leaves); give a global batch that is a multiple of {invariant.LEAVES}"
        )
    trainable = [param for param in parameters if param.requires_grad]
    gradients: list[tuple[int, torch.Tensor]] = []  # (leaves summed, their sum): a binary counter, log2 of them held
    losses = []
    for leaf in sorted(range(local), key=lambda q: _reversed(q, local)):  # the leaves r + dp q, in the tree's order
        part = inputs[leaf::local]
        for param in trainable:
            param.grad = None
        loss = loss_of(part) / invariant.LEAVES  # its share of the batch's mean: an exact power-of-two scaling
        loss.backward()
        losses.append(loss.detach().reshape(1))
        gradients.append((1, _flat(trainable)))
        while len(gradients) > 1 and gradients[-1][0] == gradients[-2][0]:  # two subtrees of one size: their parent
            (count, right), (_, left) = gradients.pop(), gradients.pop()
            gradients.append((2 * count, left + right))
    order = sorted(range(ranks), key=lambda rank: _reversed(rank, ranks))  # the ranks' subtrees, in the tree's order
    summed = invariant.finish_sum(gradients[0][1], replicas, order)  # local: a power of two, so one subtree
    loss = invariant.finish_sum(invariant.tree_sum(torch.stack(losses)), replicas, order)[0]
    offset = 0
    for param in trainable:
        param.grad = summed[offset : offset + param.numel()].view_as(param).clone()
        offset += param.numel()
    return loss


def _reversed(index: int, count: int) -> int:
    """`index` with its log2(count) bits reversed (count a power of two)."""
    bits = count.bit_length() - 1
    return int(f"{index:0{bits}b}"[::-1], 2) if bits else 0


def _flat(parameters: list[nn.Parameter]) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector (zeros for a parameter the leaf did not reach)."""
    return torch.cat([
        (param.grad if param.grad is not None else torch.zeros_like(param)).reshape(-1) for param in parameters
    ])  # fmt: skip
