"""Tensor-parallel layers (Megatron-LM, arXiv 1909.08053): each holds one rank's shard of a weight."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel import invariant
from tp_train.parallel.collectives import (
    CommunicationCounter,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region_,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_tensor_parallel_region,
    scatter_to_tensor_parallel_region,
)
from tp_train.parallel.overlap import can_overlap, enter_with_overlap, linear_with_deferred_weight_gradient
from tp_train.parallel.sharding import ShardSpec, check_divisible, shard_tensor

# How the input of a column-parallel layer is laid out, which decides how it enters the parallel region:
# replicated (Megatron's `f`), sharded along the sequence (all-gathered, as under sequence parallelism), or already
# gathered by the enclosing attention / MLP module under sequence parallelism (nothing to do).
REPLICATED_INPUT, SEQUENCE_SHARDED_INPUT, GATHERED_INPUT = "replicated", "sequence_sharded", "gathered"


class Configurable:
    """A parallel layer's settings: given to its constructor, or changed afterwards through `configure` alone."""

    SETTINGS: tuple[str, ...] = ()

    def configure(self, **settings) -> None:
        """Sets each named setting (one of `SETTINGS`; anything else is a `TypeError`)."""
        unknown = sorted(set(settings) - set(self.SETTINGS))
        if unknown:
            raise TypeError(f"{type(self).__name__} has no setting {unknown}; its settings: {list(self.SETTINGS)}")
        for name, value in settings.items():
            setattr(self, name, value)


class SharedInputRegion(Configurable):
    """One `copy_to_tensor_parallel_region` shared by sibling column-parallel layers that read the same input."""

    SETTINGS = ("input_layout", "comm_counter", "overlap")

    def __init__(
        self,
        group: ProcessGroup,
        input_layout: str = REPLICATED_INPUT,
        comm_counter: CommunicationCounter | None = None,
        layers: tuple[nn.Module, ...] = (),
        overlap: bool = True,
    ):
        self.group = group
        self.input_layout = input_layout
        self.comm_counter = comm_counter
        self.layers = tuple(layers)
        self.overlap = overlap
        self.reset()

    def reset(self) -> None:
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self.deferred = None  # where the layers reading `_output` defer their weight gradients, with overlap

    def copy_to(self, x: torch.Tensor) -> torch.Tensor:
        if x is self._output:
            return x
        if self._input is not x:
            parameters = [p for layer in self.layers for p in (layer.weight, layer.bias)] if self.overlap else None
            self._input = x
            self._output, self.deferred = enter_column_parallel(
                x, self.group, self.input_layout, self.comm_counter, overlap_with=parameters
            )
        return self._output

    def deferred_for(self, x: torch.Tensor):
        """Where a layer whose input is `x` defers its weight gradients: this entry's, if `x` is its output."""
        return self.deferred if x is self._output else None


def enter_column_parallel(
    x: torch.Tensor,
    group: ProcessGroup,
    input_layout: str,
    counter: CommunicationCounter | None = None,
    overlap_with: list[torch.Tensor | None] | None = None,
):
    """(A column-parallel layer's input, by `input_layout`; where its readers defer their weight gradients, or None):
    `f` (identity forward, all-reduce backward), the all-gather of the sequence shards (reduce-scatter backward), or
    as it is (the gather that made it sums the partial gradients in its backward). With `overlap_with` (the readers'
    parameters) the backward collective runs while their weight gradients are computed."""
    if overlap_with is not None and input_layout != GATHERED_INPUT and can_overlap(group):
        return enter_with_overlap(x, overlap_with, input_layout == SEQUENCE_SHARDED_INPUT, group, counter)
    if input_layout == SEQUENCE_SHARDED_INPUT:  # contiguous: one copy here, not one per matmul that folds it
        return gather_from_sequence_parallel_region(x, group, counter).contiguous(), None
    if input_layout == GATHERED_INPUT:
        return x, None
    return copy_to_tensor_parallel_region(x, group, counter), None


class ColumnParallelLinear(Configurable, nn.Module):
    """Y = X A + b with A split by columns (output features): rank r computes Y_r = X A_r + b_r.

    Args:
        in_features: input width (replicated).
        out_features: full output width. Split into `sections` (default: one section of all of it), each split
            evenly across ranks; with `pad_output` a single section is padded up to a multiple of the world size
            (a vocabulary) and the gathered output is trimmed back. `units`: the heads in each section; a section
            with fewer heads than ranks is replicated, each head held by the ranks whose query heads use it (see
            `tp_train.parallel.sharding`). Not with `gather_output`.
        group: the tensor-parallel process group.
        gather_output: return the full (replicated) output instead of this rank's shard.
        input_layout, input_region, comm_counter, overlap: see `Configurable`.
        loss_fusion: a `HeadLossFusion`: while it defers, forward returns its input (in the parallel region) for the
            loss to compute this head and the loss together (`vocab_parallel_linear_cross_entropy`).
    """

    SETTINGS = ("input_layout", "input_region", "comm_counter", "overlap", "loss_fusion", "numerics")
    feature_dim = -1  # where its input and output hold the features
    numerics = invariant.FAST  # "invariant": `invariant.linear`, its input gradient's sum finished in this layer

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        bias: bool = True,
        gather_output: bool = False,
        sections: tuple[int, ...] | None = None,
        units: tuple[int, ...] | None = None,
        pad_output: bool = False,
        device=None,
        dtype=None,
        input_layout: str = REPLICATED_INPUT,
        input_region: SharedInputRegion | None = None,
        comm_counter: CommunicationCounter | None = None,
        overlap: bool = True,
        loss_fusion=None,
    ):
        super().__init__()
        self.group = group
        self.overlap = overlap  # backward: the input gradient's collective runs while the weight gradient is computed
        self.loss_fusion = loss_fusion
        self.in_features = in_features
        self.out_features = out_features
        self.gather_output = gather_output
        self.input_layout = input_layout  # see enter_column_parallel
        self.input_region = input_region  # one entry into the parallel region shared with sibling layers
        self.comm_counter = comm_counter
        spec = ShardSpec(dim=0, sections=tuple(sections or (out_features,)), padded=pad_output, units=units)
        if not pad_output:
            world_size = dist.get_world_size(group)
            for size, copies in zip(spec.sections, spec.replicas(world_size), strict=True):
                check_divisible("ColumnParallelLinear", "out_features (per section)", size * copies, world_size)
        local_out = sum(spec.local_sections(dist.get_world_size(group)))
        self.weight = nn.Parameter(torch.empty(local_out, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)) if bias else None
        self.shard_specs = {"weight": spec, "bias": spec} if bias else {"weight": spec}  # the bias splits as the rows
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """This rank's slice of `nn.Linear`'s initialisation of the full layer (the same random numbers as
        `nn.Linear(in_features, out_features)` draws, so every TP rank must share the generator state)."""
        _init_from_full(self, (self.out_features, self.in_features), lambda w, b: _linear_init(w, b, self.in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == invariant.INVARIANT:
            y = invariant.linear(x, self.weight, self.bias, output_group=self.group)
            return self._gathered(y) if self.gather_output else y
        if self.loss_fusion is not None and self.loss_fusion.active:  # the loss computes this layer's output
            return self.loss_fusion.hold(
                enter_column_parallel(x, self.group, self.input_layout, self.comm_counter)[0], self
            )
        if self.input_region is not None:
            x = self.input_region.copy_to(x)
            deferred = self.input_region.deferred_for(x) if self.overlap else None
        else:
            overlap_with = [self.weight, self.bias] if self.overlap else None
            x, deferred = enter_column_parallel(x, self.group, self.input_layout, self.comm_counter, overlap_with)
        if deferred is not None:  # the weight gradient is computed while the input gradient's collective runs
            y = linear_with_deferred_weight_gradient(x, self.weight, self.bias, deferred)
        else:
            y = F.linear(x, self.weight, self.bias)  # (..., out_features / tp)
        return self._gathered(y) if self.gather_output else y  # one call fewer per layer where nothing is gathered

    def _gathered(self, y: torch.Tensor) -> torch.Tensor:
        """Every rank's `y` (this rank's output), in order, as the whole output (`gather_output`)."""
        y = gather_from_tensor_parallel_region(y, self.group, self.comm_counter)  # (..., tp * local): rank-major
        sections = self.shard_specs["weight"].sections
        if len(sections) > 1:  # [q0 k0 v0 | q1 k1 v1] -> [q0 q1 | k0 k1 | v0 v1]
            world_size = dist.get_world_size(self.group)
            local = list(self.shard_specs["weight"].local_sections(world_size))
            per_rank = [chunk.split(local, dim=-1) for chunk in y.chunk(world_size, dim=-1)]
            y = torch.cat([piece[i] for i in range(len(sections)) for piece in per_rank], dim=-1)
        return y if y.size(-1) == self.out_features else y[..., : self.out_features]  # the padding cut

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.weight.shape[0]}), bias={self.bias is not None}, gather_output={self.gather_output}"
        )


class RowParallelLinear(Configurable, nn.Module):
    """Y = X A + b with A split by rows (input features): rank r computes the partial sum X_r A_r.

    Args:
        in_features: full input width, split evenly across ranks; or into `sections`, each split evenly, rank r
            holding its chunk of every section in turn (CodeGen's out_proj, reading each rank's heads of every one of
            its four [q; v; k] groups). Not with `split_input`.
        out_features: output width (replicated; split evenly across ranks with `scatter_output`).
        group: the tensor-parallel process group.
        split_input: take a replicated input and keep this rank's share of its features.
        scatter_output: keep this rank's chunk of the output's features (and of the bias).
        sequence_parallel, comm_counter: see `Configurable`; `partial_output`: see above.
    """

    SETTINGS = ("sequence_parallel", "comm_counter", "partial_output", "numerics")
    feature_dim = -1  # where its input and output hold the features
    numerics = invariant.FAST  # "invariant": `invariant.linear`, the partial sums finished in one fixed order

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: ProcessGroup,
        bias: bool = True,
        device=None,
        dtype=None,
        split_input: bool = False,
        scatter_output: bool = False,
        sequence_parallel: bool = False,
        comm_counter: CommunicationCounter | None = None,
        partial_output: bool = False,
        sections: tuple[int, ...] | None = None,
    ):
        super().__init__()
        self.group = group
        self.partial_output = partial_output  # this rank's unreduced, unbiased partial sum
        self.split_input = split_input
        self.scatter_output = scatter_output
        self.sequence_parallel = sequence_parallel  # output reduce-scattered along the sequence
        self.comm_counter = comm_counter
        self.in_features = in_features
        self.out_features = out_features
        self.world_size = world_size = dist.get_world_size(group)  # read once: the forward asks it every call
        sections = tuple(sections or (in_features,))
        if sum(sections) != in_features or split_input and len(sections) > 1:
            raise ValueError(
                f"RowParallelLinear: sections {sections} must add up to in_features={in_features}, and "
                f"split_input takes one (it keeps a contiguous share of a replicated input)"
            )
        for size in sections:
            check_divisible(
                "RowParallelLinear", "in_features" + (" (per section)" if sections[1:] else ""), size, world_size
            )
        local_out = out_features
        if scatter_output:
            check_divisible("RowParallelLinear with scatter_output", "out_features", out_features, world_size)
            local_out = out_features // world_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features // world_size, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(local_out, device=device, dtype=dtype)) if bias else None
        self.shard_specs = {"weight": ShardSpec(dim=1, sections=sections)}
        if scatter_output and bias:
            self.shard_specs["bias"] = ShardSpec(dim=0, sections=(out_features,))
        self.reset_parameters()

    reset_parameters = ColumnParallelLinear.reset_parameters

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.numerics == invariant.INVARIANT:
            return invariant.linear(x, self.weight, self.bias, contracted_group=self.group)
        if self.world_size == 1 and not self.partial_output:  # no collective between: the bias in the matmul
            return F.linear(x, self.weight, self.bias)
        if self.split_input:
            x = scatter_to_tensor_parallel_region(x, self.group, self.comm_counter)
        if self.partial_output:
            return F.linear(x, self.weight)
        if self.scatter_output:  # its output feeds this rank's heads only, never the residual stream
            y = reduce_scatter_to_tensor_parallel_region(F.linear(x, self.weight), self.group, self.comm_counter)
            return y + self.bias.to(y.dtype) if self.bias is not None else y
        if self.sequence_parallel:  # each rank keeps its sequence chunk of the sum; the bias is added to it
            y = reduce_scatter_to_sequence_parallel_region(F.linear(x, self.weight), self.group, self.comm_counter)
            return y + self.bias.to(y.dtype) if self.bias is not None else y  # y is a view: not in place
        # In place: the matmul's output is this layer's own, and its backward does not read it.
        y = reduce_from_tensor_parallel_region_(F.linear(x, self.weight), self.group, self.comm_counter)
        return y.add_(self.bias.to(y.dtype)) if self.bias is not None else y  # y is ours; dtype as nn.Linear's

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.weight.shape[1]}), out_features={self.out_features}, "
            f"bias={self.bias is not None}{', split_input=True' if self.split_input else ''}"
            f"{', scatter_output=True' if self.scatter_output else ''}"
        )


class ModuleRegion(Configurable):
    """Collectives around a module that computes on its own shards of parameters and swaps nothing: a mixture of
    experts' module holding each rank's share of every expert's weights (Hugging Face's fused 3-D `gate_up_proj`
    and `down_proj`), or a module whose output is a partial sum.
    """

    SETTINGS = ("comm_counter",)

    def __init__(
        self,
        group: ProcessGroup,
        enter: bool = False,
        leave: bool = False,
        input_scale: float | None = None,
        output_tail: int | None = None,
        comm_counter: CommunicationCounter | None = None,
        bias: nn.Parameter | None = None,
    ):
        self.group = group
        self.enter, self.leave, self.input_scale, self.output_tail = enter, leave, input_scale, output_tail
        self.comm_counter = comm_counter
        self.bias = bias

    def install(self, module: nn.Module) -> None:
        if self.enter or self.input_scale is not None:
            module.register_forward_pre_hook(self._inputs, with_kwargs=True)
        if self.leave or self.output_tail:
            module.register_forward_hook(self._output)

    def _inputs(self, module, args, kwargs):
        if self.input_scale is not None and args and isinstance(args[0], torch.Tensor):
            args = (args[0] * self.input_scale, *args[1:])
        if self.enter:
            args = tuple(self._enter(value) for value in args)
            kwargs = {key: self._enter(value) for key, value in kwargs.items()}
        return args, kwargs

    def _enter(self, value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return copy_to_tensor_parallel_region(value, self.group, self.comm_counter)
        return value

    def _output(self, module, args, output):
        if self.output_tail and isinstance(output, torch.Tensor):
            head, tail = output.split([output.shape[-1] - self.output_tail, self.output_tail], dim=-1)
            return torch.cat([head, copy_to_tensor_parallel_region(tail, self.group, self.comm_counter)], dim=-1)
        if isinstance(output, torch.Tensor):
            output = reduce_from_tensor_parallel_region(output, self.group, self.comm_counter)
            return output + self.bias.to(output.dtype) if self.bias is not None else output
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (reduce_from_tensor_parallel_region(output[0], self.group, self.comm_counter), *output[1:])
        raise TypeError(f"{type(module).__name__} returned {type(output).__name__}, not a tensor to all-reduce")


class VocabParallelEmbedding(Configurable, nn.Module):
    """An embedding table split along the vocabulary: rank r holds rows [r * V/tp, (r+1) * V/tp) of the table,
    the vocabulary padded up to a multiple of tp with zero rows.
    """

    SETTINGS = ("comm_counter",)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        group: ProcessGroup,
        padding_idx: int | None = None,
        device=None,
        dtype=None,
        comm_counter: CommunicationCounter | None = None,
    ):
        super().__init__()
        self.group = group
        self.comm_counter = comm_counter
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        if padding_idx is not None and padding_idx < 0:  # as nn.Embedding: counted from the end
            padding_idx += num_embeddings
        self.padding_idx = padding_idx
        spec = ShardSpec(dim=0, sections=(num_embeddings,), padded=True)
        self.world_size = dist.get_world_size(group)  # read once: the forward asks it every call
        rows = spec.slices(dist.get_rank(group), self.world_size)[0]
        self.vocab_start, self.vocab_end = rows.start, rows.start + rows.real
        self.weight = nn.Parameter(torch.empty(rows.local, embedding_dim, device=device, dtype=dtype))
        self.shard_specs = {"weight": spec}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """This rank's rows of `nn.Embedding`'s initialisation of the full table (N(0, 1), padding row zero)."""

        def init(weight, _):
            nn.init.normal_(weight)
            if self.padding_idx is not None:
                weight[self.padding_idx].zero_()

        _init_from_full(self, (self.num_embeddings, self.embedding_dim), init)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:  # the whole table: nn.Embedding's lookup, nothing to mask or sum
            return F.embedding(ids, self.weight, padding_idx=self.padding_idx)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        local_padding_idx = None
        if self.padding_idx is not None and self.vocab_start <= self.padding_idx < self.vocab_end:
            local_padding_idx = self.padding_idx - self.vocab_start
        out = F.embedding(local_ids, self.weight, padding_idx=local_padding_idx)
        out.masked_fill_(
            outside.unsqueeze(-1), 0.0
        )  # in place on the lookup's own output, which its backward does not read
        return reduce_from_tensor_parallel_region_(out, self.group, self.comm_counter)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, local rows [{self.vocab_start}, {self.vocab_end})"


def _linear_init(weight: torch.Tensor, bias: torch.Tensor | None, fan_in: int) -> None:
    """`nn.Linear.reset_parameters`, on full-size tensors."""
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(bias, -bound, bound)


@torch.no_grad()
def _init_from_full(layer: nn.Module, weight_shape: tuple[int, int], init) -> None:
    """Initialises full-size tensors with `init(weight, bias)` and copies this rank's shard of each into `layer`.

    Full tensors are built one layer at a time, so every rank draws the same numbers as the unsharded layer would."""
    if layer.weight.is_meta:
        return  # materialised later
    rank, world_size = dist.get_rank(layer.group), dist.get_world_size(layer.group)
    options = dict(device=layer.weight.device, dtype=layer.weight.dtype)
    bias = getattr(layer, "bias", None)
    full_weight = torch.empty(weight_shape, **options)
    full_bias = torch.empty(weight_shape[0], **options) if bias is not None else None
    init(full_weight, full_bias)
    for name, full in (("weight", full_weight), ("bias", full_bias)):
        if full is None:
            continue
        spec = layer.shard_specs.get(name)
        getattr(layer, name).copy_(shard_tensor(full, spec, rank, world_size) if spec is not None else full)
