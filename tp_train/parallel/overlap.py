"""Backward overlap for column-parallel layers: the input gradient's collective runs while the weight gradients
are computed (the idea of Megatron-LM's `LinearWithGradAccumulationAndAsyncCommunication`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import (
    SEQUENCE_DIM,
    CommunicationCounter,
    all_reduce_async,
    gather_from_sequence_parallel_region,
    reduce_scatter_async,
)


def can_overlap(group: ProcessGroup) -> bool:
    """Whether the overlapped path applies: eager, building a graph, more than one rank."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling() and group.size() > 1


class DeferredWeightGradients:
    """What the layers reading one entry's output hand to it in backward: per use of a weight, its index (and its
    bias's) among the entry's parameters, the output gradient and the input."""

    def __init__(self, parameters: list[torch.Tensor]):
        self.index = {id(p): i for i, p in enumerate(parameters)}
        self.pending: list[tuple[int, int | None, torch.Tensor, torch.Tensor]] = []
        self.open = True  # until the entry's backward has run

    def compute(self, count: int, needed: tuple[bool, ...], dtypes: list[torch.dtype]) -> list:
        """The deferred gradients, one per entry parameter (None where nothing was deferred or none is needed)."""
        grads: list[torch.Tensor | None] = [None] * count
        for weight_index, bias_index, grad_output, x in self.pending:
            weight_grad, bias_grad = _weight_gradients(grad_output, x, needed[weight_index], bias_index is not None)
            for index, grad in ((weight_index, weight_grad), (bias_index, bias_grad)):
                if index is None or grad is None or not needed[index]:
                    continue
                grad = grad.to(dtypes[index])
                grads[index] = grad if grads[index] is None else grads[index] + grad
        self.pending.clear()
        self.open = False
        return grads


def enter_with_overlap(
    x: torch.Tensor,
    parameters: list[torch.Tensor],
    gather_sequence: bool,
    group: ProcessGroup,
    counter: CommunicationCounter | None = None,
) -> tuple[torch.Tensor, DeferredWeightGradients]:
    """The column-parallel region's entry with backward overlap, for the layers holding `parameters`."""
    parameters = [p for p in parameters if p is not None]
    deferred = DeferredWeightGradients(parameters)
    entered = _EnterWithOverlap.apply(x, gather_sequence, group, counter, deferred, *parameters)
    return entered, deferred


def linear_with_deferred_weight_gradient(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, deferred: DeferredWeightGradients
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` whose backward computes the input gradient and hands the weight and bias
    gradients' inputs to `deferred` (the entry `x` came from), which computes them while its collective runs.
    Under autocast the operands are cast as `F.linear` casts them, and the gradients back to their dtypes."""
    if id(weight) not in deferred.index or (bias is not None and id(bias) not in deferred.index):
        return F.linear(x, weight, bias)  # not among the entry's parameters (replaced since): no deferral
    # 2-D through the Function, whose output is then a tensor of its own, not a view made inside it (F.linear views
    # a 3-D input's matmul): a model may modify it in place (Swin V2's position-bias MLP); reshaped outside.
    output = _LinearWithDeferredWeightGradient.apply(x.reshape(-1, x.shape[-1]), weight, bias, deferred)
    return output.view(*x.shape[:-1], output.shape[-1])


class _EnterWithOverlap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gather_sequence, group, counter, deferred, *parameters):
        ctx.gather_sequence, ctx.group, ctx.counter, ctx.deferred = gather_sequence, group, counter, deferred
        ctx.dtypes = [p.dtype for p in parameters]
        if gather_sequence:  # autograd is off in here: the plain forward collective, counted
            return gather_from_sequence_parallel_region(x, group, counter).contiguous()
        return x  # as `f` returns it (autograd makes the output a view of it)

    @staticmethod
    def backward(ctx, grad):
        pending = None
        if ctx.needs_input_grad[0]:
            if ctx.gather_sequence:
                pending = reduce_scatter_async(grad, SEQUENCE_DIM, ctx.group, ctx.counter)
            else:
                pending = all_reduce_async(grad, ctx.group, ctx.counter)
        parameter_grads = ctx.deferred.compute(len(ctx.dtypes), ctx.needs_input_grad[5:], ctx.dtypes)
        grad_input = pending.wait() if pending is not None else None
        return (grad_input, None, None, None, None, *parameter_grads)


class _LinearWithDeferredWeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, deferred):
        ctx.indices = (deferred.index[id(weight)], deferred.index[id(bias)] if bias is not None else None)
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype if bias is not None else None)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # cast as autocast's F.linear would, so the saved tensors are cast
            dtype = torch.get_autocast_dtype(device)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        ctx.save_for_backward(x, weight)
        ctx.deferred = deferred
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        # 2-D once: the input gradient's and the weight gradient's matmuls share one copy of a strided gradient
        shape = grad_output.shape
        grad_output, x = grad_output.reshape(-1, shape[-1]), x.reshape(-1, x.shape[-1])
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.mm(weight).view(*shape[:-1], weight.shape[1]).to(ctx.dtypes[0])
        weight_index, bias_index = ctx.indices
        needs_weight, needs_bias = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        if not (needs_weight or needs_bias):
            return grad_input, None, None, None
        if ctx.deferred.open:
            ctx.deferred.pending.append((weight_index, bias_index if needs_bias else None, grad_output, x))
            return grad_input, None, None, None
        # The entry's backward already ran (not expected: it is an ancestor of this node): compute them here.
        weight_grad, bias_grad = _weight_gradients(grad_output, x, needs_weight, needs_bias)
        weight_grad = weight_grad.to(ctx.dtypes[1]) if weight_grad is not None else None
        bias_grad = bias_grad.to(ctx.dtypes[2]) if bias_grad is not None else None
        return grad_input, weight_grad, bias_grad, None


def _weight_gradients(grad_output: torch.Tensor, x: torch.Tensor, weight: bool, bias: bool):
    """The gradients of `F.linear`'s weight and bias from the 2-D output gradient and input, in their dtype."""
    return grad_output.t().mm(x) if weight else None, grad_output.sum(0) if bias else None
