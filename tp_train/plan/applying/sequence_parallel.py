"""Sequence parallelism (Korthikanti et al., arXiv 2205.05198) on a model already sharded by its plan: the residual
stream between the blocks is split along the sequence, each all-reduce becomes an all-gather plus a reduce-scatter."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import CommunicationCounter, all_reduce_gradient, scatter_to_sequence_parallel_region
from tp_train.parallel.layers import (
    GATHERED_INPUT,
    SEQUENCE_SHARDED_INPUT,
    ColumnParallelLinear,
    RowParallelLinear,
    SharedInputRegion,
)
from tp_train.parallel.random import SHARDED, TensorParallelRNG
from tp_train.plan.gradient_hooks import register_gradient_hook
from tp_train.plan.layout import BlockLayout
from tp_train.plan.styles import FEEDS_PARALLEL_REGION, REGION_STYLES, adapted_base


class _Region:
    """Whether the residual stream is sequence-sharded right now (first block's input .. the head's input)."""

    active = False
    shard_shape: tuple[int, ...] = ()  # this rank's (batch, sequence / tp, hidden) at the first block


def check_sequence_parallel(model: nn.Module, layout: BlockLayout) -> None:
    """Raises a one-line `ValueError` if `model`'s structure cannot be made sequence-parallel."""
    if layout.head is None:
        raise ValueError(
            f"sequence_parallel needs one output head planned 'colwise_gather_output' after the blocks (the "
            f"sequence is gathered at its input); {type(model).__name__}'s plan has none: shard a model with "
            f"its LM head, or use sequence_parallel=False"
        )
    # `rowwise(feeds_parallel_region)`: its output, sequence-sharded, would feed full channels
    unsupported = {*REGION_STYLES, "rowwise_split_input", f"rowwise({FEEDS_PARALLEL_REGION})"}
    for name, style in layout.planned.items():
        if style in unsupported or (style == "colwise_gather_output" and layout.in_blocks(name)):
            raise ValueError(
                f"sequence_parallel does not support '{name}' planned '{style}' (its collectives assume a "
                f"replicated input and output); use sequence_parallel=False"
            )
    adapted = next((name for name in layout.planned if adapted_base(model.get_submodule(name)) is not None), None)
    if adapted is not None:
        raise ValueError(
            f"sequence_parallel does not support adapters yet: '{adapted}' is a "
            f"{type(model.get_submodule(adapted)).__name__} (an adapter beside its sharded layer); use "
            f"sequence_parallel=False"
        )
    for name in sorted(layout.sub_blocks):
        if type(model.get_submodule(name)).forward is nn.Module.forward:
            raise ValueError(
                f"sequence_parallel: '{name}' holds parallel layers but has no forward of its own (the block calls "
                f"them directly), so there is no input to gather the sequence into; give the attention / MLP a "
                f"module with a forward, or use sequence_parallel=False"
            )


def apply_sequence_parallel(
    model: nn.Module,
    layout: BlockLayout,
    group: ProcessGroup,
    rng: TensorParallelRNG,
    counter: CommunicationCounter | None = None,
):
    """Turns the sharded `model` sequence-parallel between its blocks (see the module docstring)."""
    region = _Region()
    head = model.get_submodule(layout.head)
    for name in layout.blocks:
        rng.run_in(model.get_submodule(name), SHARDED)
    inside: dict[str, list[ColumnParallelLinear]] = {name: [] for name in layout.sub_blocks}
    for name, layer in model.named_modules():
        if not layout.in_blocks(name):
            continue
        # A row layer keeping its heads' share of its output (`scatter_output`) reads a column layer's output, whose
        # input was gathered whole, and feeds those heads, never the residual stream: its sequence stays whole.
        if isinstance(layer, RowParallelLinear) and not layer.scatter_output:
            layer.configure(sequence_parallel=True)
        if isinstance(layer, ColumnParallelLinear):
            # Inside an attention / MLP module the module's input was gathered whole (its code may read the
            # sequence length off it); a column layer right in the block gathers its own input.
            parent = name.rpartition(".")[0]
            layer.configure(input_layout=GATHERED_INPUT if parent in inside else SEQUENCE_SHARDED_INPUT)
            if layer.input_region is not None:
                layer.input_region.configure(input_layout=layer.input_layout)
            if parent in inside:
                inside[parent].append(layer)
    for name in sorted(layout.sub_blocks):
        # One all-gather shared by all the module's column layers (reduce-scatter in backward), made contiguous
        # once here: q, k and v would each copy a strided gather to fold it into a matmul, and keep the copy. The
        # layers read it through the same region, whose backward computes their weight gradients while the
        # reduce-scatter runs (`tp_train.parallel.overlap`).
        sub_block = model.get_submodule(name)
        gather = SharedInputRegion(group, SEQUENCE_SHARDED_INPUT, counter, layers=tuple(inside[name]))
        for layer in inside[name]:
            layer.configure(input_region=gather)
        sub_block.register_forward_pre_hook(lambda *_, gather=gather: gather.reset())
        _map_input(sub_block, gather.copy_to)
        sub_block.register_forward_hook(lambda *_, gather=gather: gather.reset(), always_call=True)
    head.configure(input_layout=SEQUENCE_SHARDED_INPUT)
    world_size = dist.get_world_size(group)

    def enter(hidden: torch.Tensor) -> torch.Tensor:
        region.active = True
        if hidden.size(1) % world_size:
            raise ValueError(
                f"sequence_parallel: sequence length {hidden.size(1)} is not divisible by tensor_parallel_size="
                f"{world_size}; use a sequence length that is a multiple of {world_size}"
            )
        region.shard_shape = (*hidden.shape[:1], hidden.size(1) // world_size, *hidden.shape[2:])
        return scatter_to_sequence_parallel_region(hidden, group, counter)

    def leave(*_):
        region.active = False

    def reach_head(head, args):
        if region.active and tuple(args[0].shape) != region.shard_shape:
            raise ValueError(
                f"sequence_parallel: {type(model).__name__} reshapes the hidden states between its blocks and its "
                f"head ({region.shard_shape} -> {tuple(args[0].shape)}), which sequence shards do not survive; "
                f"use sequence_parallel=False for this model"
            )
        region.active = False

    def within(hidden: torch.Tensor) -> torch.Tensor:
        # A pipeline stage starts at a later block with the stream already sharded (tp_train.parallel.pipeline)
        region.active, region.shard_shape = True, tuple(hidden.shape)
        return hidden

    _map_input(model.get_submodule(layout.blocks[0]), enter)
    for name in layout.blocks[1:]:
        _map_input(model.get_submodule(name), within)
    head.register_forward_pre_hook(reach_head)
    model.register_forward_pre_hook(leave)  # a forward that failed midway leaves no stale state
    _reduce_replicated_gradients(model, layout, group, region)
    for name, style in layout.planned.items():
        if style == "replicated_rng" and layout.in_blocks(name):
            # Dropout on the residual stream, which is sequence-sharded now: back to the sharded stream.
            rng.run_in(model.get_submodule(name), SHARDED)


def _reduce_replicated_gradients(model: nn.Module, layout: BlockLayout, group: ProcessGroup, region: _Region):
    """All-reduces the gradient of every replicated parameter applied to sequence shards: inside the blocks, those
    outside the sub-blocks' interiors plus row-parallel biases; outside them, those of modules that run while the
    region is active (a final norm), found at each forward."""
    reduced: set[int] = set()
    in_head = {id(m) for m in model.get_submodule(layout.head).modules()}
    for name, module in model.named_modules():
        if layout.planned.get(name) == "replicated_with_grad_allreduce":
            continue  # summed over the group already (a norm over local heads)
        sharded = getattr(module, "shard_specs", {})
        params = {
            key: p for key, p in module.named_parameters(recurse=False) if key not in sharded and id(p) not in reduced
        }
        if not params or id(module) in in_head:
            continue
        if layout.in_blocks(name):
            interior = any(name.startswith(sub + ".") for sub in layout.sub_blocks) or name in layout.sub_blocks
            if interior and not isinstance(module, RowParallelLinear):
                continue
            for key in params:
                register_gradient_hook(module, key, lambda grad: all_reduce_gradient(grad, group))
        else:
            seen = {"in_region": False}
            module.register_forward_pre_hook(lambda *_, seen=seen: seen.update(in_region=region.active))
            for key in params:
                register_gradient_hook(
                    module, key, lambda grad, seen=seen: all_reduce_gradient(grad, group) if seen["in_region"] else grad
                )
        reduced.update(id(p) for p in params.values())


def _map_input(module: nn.Module, fn) -> None:
    """Replaces `module`'s input (its first argument, positional or by name) by `fn(input)` before each forward."""
    parameters = list(inspect.signature(module.forward).parameters)
    first = parameters[0] if parameters else None

    def hook(module, args, kwargs):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if first in kwargs:
            return args, {**kwargs, first: fn(kwargs[first])}
        raise ValueError(
            f"sequence_parallel: {type(module).__name__} was called without its input '{first}'; sequence "
            f"parallelism splits a block's and gathers an attention / MLP module's first argument"
        )

    module.register_forward_pre_hook(hook, with_kwargs=True)
