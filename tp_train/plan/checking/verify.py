"""Plan verification: the sharded model must compute what the unsharded one does, checked per swapped module
(`SwapCheck`), per region (`region_check`) and whole (`verify_parallelized`); docs/planner.md ("Verification")."""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from functools import partial
from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.errors import PlanVerificationError, first_line
from tp_train.parallel.agreement import failures_agreed
from tp_train.parallel.collectives import gather_from_tensor_parallel_region
from tp_train.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tp_train.parallel.sharding import (
    ShardSpec,
    full_state_dict,
    named_sharded_parameters,
    shard_tensor,
    split_among_replicas,
    unshard_tensor,
    unshard_tensors,
)
from tp_train.plan.compare import first_tensor, relative_difference
from tp_train.plan.gradient_hooks import requiring_grad
from tp_train.plan.probe import eval_mode, forward_without_cache, hooks_removed, running_modules
from tp_train.plan.probe_input import PROBE_TOKENS, ProbeInput, probe_input
from tp_train.plan.styles import adapted_base

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}  # relative to the largest reference value
HALF_PRECISION_TOLERANCE = 3e-2


class SwapCheck:
    """Checks each module `apply_plan` swaps against the module it replaced (pass it as `apply_plan`'s `check`).

    `errors`: the largest relative difference per module; `skipped`: modules whose full tensors were already gone
    (tied to one swapped before), checked through the module they are tied to. Each call is a collective; the first
    module that differs, or that fails to run, raises `PlanVerificationError` (run the calls in
    `failures_agreed`, so that every rank raises it)."""

    def __init__(self, group: ProcessGroup, tolerance: float | None = None):
        self.group = group
        self.tolerance = tolerance
        self.errors: dict[str, float] = {}
        self.skipped: list[str] = []

    def __call__(self, name: str, module: nn.Module, layer: nn.Module) -> None:
        if any(tensor.is_meta for tensor in chain(module.parameters(), module.buffers())):
            self.skipped.append(name)
            return
        tolerance = self.tolerance or TOLERANCE.get(module.weight.dtype, HALF_PRECISION_TOLERANCE)
        swapped = f"module '{name}' ({type(module).__name__}) sharded as {type(layer).__name__}"
        try:
            errors = self._differences(module, layer)
        except Exception as error:  # a layer that cannot run is reported like a wrong one
            problem = f"{swapped} fails on a probe input ({first_line(error)})"
            raise verification_error(problem, self.group) from error
        finally:
            module.zero_grad(set_to_none=True)
            layer.zero_grad(set_to_none=True)
        worst = max(errors, key=errors.get)
        self.errors[name] = errors[worst]
        if errors[worst] > tolerance:
            what = f"differs from it by {errors[worst]:.3g} in its {worst} (relative; tolerance {tolerance:.0e})"
            raise verification_error(f"{swapped} {what}", self.group)

    def _differences(self, module: nn.Module, wrapped: nn.Module) -> dict[str, float]:
        rank, world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        weight = module.weight
        generator = torch.Generator().manual_seed(0)
        layer = adapted_base(wrapped) or wrapped  # a LoRA layer runs as a whole, laid out as its base
        vocabulary = isinstance(layer, VocabParallelEmbedding) or layer.shard_specs["weight"].padded
        if isinstance(layer, VocabParallelEmbedding):
            inputs = torch.randint(0, layer.num_embeddings, (1, PROBE_TOKENS), generator=generator)
            inputs = local_inputs = inputs.to(weight.device)
        else:
            shape = (1, PROBE_TOKENS, layer.in_features) if layer.feature_dim == -1 else (1, layer.in_features, 1, 2)
            inputs = torch.randn(shape, generator=generator).to(weight)  # a 1x1 conv's channels at dim 1, on 1 x 2
            local_inputs = _input_shard(layer, inputs, rank, world_size)
            inputs, local_inputs = inputs.requires_grad_(), local_inputs.detach().requires_grad_()
        # Parameter gradients are compared where a subclass overrides forward (only there can they differ once the
        # output and the input gradient agree) and the tensors are not vocabulary-sized; elsewhere none is allocated.
        plain = type(module).forward in (nn.Linear.forward, nn.Embedding.forward) or type(module).__name__ == "Conv1D"
        compare_parameters = not vocabulary and not plain
        params = chain(module.parameters(), wrapped.parameters())
        with requiring_grad(params, lambda param: param.requires_grad and compare_parameters):
            reference = module(inputs)
            output = wrapped(local_inputs)
        spec = None
        if isinstance(layer, ColumnParallelLinear) and not layer.gather_output:
            weight_spec = layer.shard_specs["weight"]
            features = layer.feature_dim % output.dim()
            spec = ShardSpec(features, weight_spec.sections, weight_spec.padded, units=weight_spec.units)
        elif isinstance(layer, RowParallelLinear) and layer.scatter_output:  # this rank's share of the output
            spec = ShardSpec(output.dim() - 1, (layer.out_features,))
        full_output = unshard_tensor(output.detach(), spec, self.group) if spec else output
        errors = {"output": relative_difference(full_output, reference)}
        if not reference.requires_grad:  # token ids in, no parameter gradient compared: nothing to backpropagate
            return errors
        projection = torch.randn(reference.shape, generator=generator).to(reference)
        local_projection = shard_tensor(projection, spec, rank, world_size) if spec else projection
        if spec:  # replicated kv heads: each replica backpropagates its share, as its own query heads would
            local_projection = split_among_replicas(local_projection, spec, world_size)
        (reference.float() * projection).sum().backward()
        (output.float() * local_projection).sum().backward()
        if inputs.is_floating_point():
            expected = _input_shard(layer, inputs.grad, rank, world_size)
            errors["input gradient"] = relative_difference(local_inputs.grad, expected)
        for param_name, param in wrapped.named_parameters(recurse=wrapped is not layer):  # a LoRA layer's adapters
            full_grad = module.get_parameter(param_name).grad
            if not compare_parameters or param.grad is None or full_grad is None:
                continue
            owner, _, leaf = param_name.rpartition(".")
            param_spec = getattr(wrapped.get_submodule(owner), "shard_specs", {}).get(leaf)
            if param_spec is not None:
                full_grad = shard_tensor(
                    full_grad.t() if param_spec.transposed else full_grad, param_spec, rank, world_size
                )
            errors[f"{param_name} gradient"] = relative_difference(param.grad, full_grad)
        return errors


def _input_shard(layer: nn.Module, inputs: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's share of `inputs`' features as `layer` takes them (a row layer that does not split its own: its
    chunk of each of its weight's sections), else `inputs`."""
    if not isinstance(layer, RowParallelLinear) or layer.split_input:
        return inputs
    spec = ShardSpec(layer.feature_dim % inputs.dim(), layer.shard_specs["weight"].sections)
    return shard_tensor(inputs.detach(), spec, rank, world_size)


def unsharded_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tensors are on the meta device (ties kept): its structure, without its memory."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    # State a forward left on a module as a plain attribute (RecurrentGemma's last recurrent state) is copied without
    # its autograd history: a tensor that has one cannot be deep-copied.
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and value.grad_fn is not None and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def unsharded_reference(skeleton: nn.Module, model: nn.Module, group: ProcessGroup) -> nn.Module:
    """`skeleton` given the sharded `model`'s weights, gathered (a collective), and its buffers (a split one outside
    the state dict, as Falcon-H1's non-persistent `mup_vector`, gathered too)."""
    state = full_state_dict(model, group)
    specs = {name: spec for name, _, spec in named_sharded_parameters(model, buffers=True)}
    buffers = {
        name: unshard_tensor(buffer, specs[name], group) if name in specs and name not in state else buffer
        for name, buffer in model.named_buffers(remove_duplicate=False)
    }
    made: dict[int, torch.Tensor] = {}
    for module_name, module in skeleton.named_modules(remove_duplicate=False):
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is None:
                    continue
                name = f"{module_name}.{key}" if module_name else key
                if id(tensor) not in made:
                    value = state[name] if name in state else buffers.get(name)
                    if value is None:
                        raise ValueError(f"verification cannot rebuild the unsharded '{name}'; pass verify=False")
                    value = value.detach().clone()
                    if isinstance(tensor, nn.Parameter):
                        value = nn.Parameter(value, tensor.requires_grad)
                    made[id(tensor)] = value
                store[key] = made[id(tensor)]
    return skeleton


def verify_parallelized(
    model: nn.Module,
    reference: nn.Module,
    group: ProcessGroup,
    planned: Sequence = (),
    example_input=None,
    tolerance: float | None = None,
) -> dict[str, float]:
    """Checks the sharded `model` against the unsharded `reference` on one probe batch (a collective): outputs, then
    every parameter's gradient; returns {"output": ..., "gradient": ...} relative differences, or raises
    `PlanVerificationError` on every rank when any rank sees one beyond `tolerance` (default 1e-4 fp32, 3e-2 half).
    Each rank reaches its verdict on its own; `failures_agreed` ends the check on every rank with the first failing
    rank's error, wherever between two collectives that rank stopped."""
    # A length every tp divides, for sequence parallelism's split: 8 tokens at tp 1, 2, 4 and 8.
    length = math.lcm(PROBE_TOKENS, dist.get_world_size(group))
    inputs = probe_input(reference, example_input, length, batch=2)
    dtype = next(reference.parameters()).dtype
    tolerance = tolerance if tolerance is not None else TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)
    with failures_agreed(group), eval_mode(model, reference):
        built = {name: type(module) for name, module in reference.named_modules()}
        try:
            ref_output, ref_modules = _forward(reference, inputs)
        except _ForwardFailure as failure:  # the unsharded model itself cannot run the probe: not the plan's fault
            raise failure.error from None
        _refuse_modules_replaced(built, reference)
        weight = torch.randn(ref_output.shape, generator=torch.Generator().manual_seed(0)).to(ref_output)
        (ref_output.float() * weight).sum().backward()
        errors, problem = _compare(model, inputs, group, ref_output, ref_modules, weight, tolerance)
        if problem is None:
            errors["gradient"], problem = _compare_gradients(model, reference, group, tolerance)
        model.zero_grad(set_to_none=True)
        if problem is not None:
            text, suspect = problem
            raise verification_error(f"{text}{_entries_near(suspect, planned)}", group)
    return errors


def _refuse_modules_replaced(built: dict[str, type], model: nn.Module) -> None:
    """Raises when `model` swapped one of its modules for another class while it ran (BigBird's attention below its
    block-sparse length): the swapped-in module is built whole, so a sharded model would compute with it wrong."""
    for name, module in model.named_modules():
        if name in built and type(module) is not built[name]:
            raise PlanVerificationError(
                f"the model replaced its module '{name}' ({built[name].__name__}) with a new {type(module).__name__} "
                f"while it ran a probe batch, and a module built during a forward is not sharded; configure the model "
                f"so that it is built with the modules it runs with"
            )


def verification_error(problem: str, group: ProcessGroup) -> PlanVerificationError:
    """The error for this rank's `problem`, as every rank reports it."""
    return PlanVerificationError(
        f"tensor-parallel plan verification failed (rank {dist.get_rank(group)}): {problem}; fix the plan, or pass "
        f"verify=False to skip this check"
    )


# What differs, as a message, and the module it points to.
Problem = tuple[str, str | None]


def _compare(model, inputs, group, ref_output, ref_modules, weight, tolerance) -> tuple[dict, Problem | None]:
    """Runs the sharded model forward and backward; its output error, and what is wrong with it if anything."""
    try:
        output, modules = _forward(model, inputs)
        if output.shape[:-1] == ref_output.shape[:-1] and output.shape[-1] < ref_output.shape[-1]:
            output = gather_from_tensor_parallel_region(output, group)[..., : ref_output.shape[-1]]  # loss_parallel
        if output.shape != ref_output.shape:
            shapes = f"{tuple(output.shape)}, the unsharded model's {tuple(ref_output.shape)}"
            return {}, (f"the sharded model's output has shape {shapes}", None)
        (output.float() * weight).sum().backward()
    except _ForwardFailure as failure:  # a plan that breaks the forward is reported like a wrong one
        where = f" in the forward of '{failure.module}'" if failure.module else ""
        return {}, (f"the sharded model fails on a probe batch{where} ({first_line(failure.error)})", failure.module)
    except Exception as error:  # noqa: BLE001 - in the backward
        return {}, (f"the sharded model fails on a probe batch ({first_line(error)})", None)
    output_error = relative_difference(output, ref_output)
    if output_error <= tolerance:
        return {"output": output_error}, None
    differing = (
        name for name, ref in ref_modules.items() if relative_difference(modules.get(name, ref), ref) > tolerance
    )
    suspect = next(differing, None)
    return {}, (
        f"the sharded model's output differs from the unsharded model's by {output_error:.3g} (relative; tolerance "
        f"{tolerance:.0e}) on a probe batch; first module whose output differs: '{suspect}'",
        suspect,
    )


def _compare_gradients(model, reference, group, tolerance) -> tuple[float, Problem | None]:
    """The largest relative gradient difference over all parameters, and the first parameter beyond tolerance."""
    errors = _gradient_errors(_gradients(model, group), dict(reference.named_parameters()))
    worst = max(errors.values(), default=0.0)
    if worst <= tolerance:
        return worst, None
    name = next(name for name, error in errors.items() if error > tolerance)
    return worst, (
        f"the outputs agree but the gradient of '{name}' differs from the unsharded model's by {errors[name]:.3g} "
        f"(relative; tolerance {tolerance:.0e}) (a parameter used on local heads may need "
        f"'replicated_with_grad_allreduce')",
        name.rpartition(".")[0],
    )


class _ForwardFailure(Exception):
    """A forward that raised, and the innermost module whose forward was running when it did."""

    def __init__(self, module: str | None, error: Exception):
        super().__init__(module, error)
        self.module, self.error = module, error


def _forward(model: nn.Module, inputs: ProbeInput) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's output, and each module's first tensor output in the order the modules returned.

    Raises:
        _ForwardFailure: naming the innermost module whose forward raised."""
    outputs: dict[str, torch.Tensor] = {}

    def record(name, module, args, output):
        tensor = first_tensor(output)
        if tensor is not None:
            outputs.setdefault(name, tensor.detach())

    handles = [module.register_forward_hook(partial(record, name)) for name, module in model.named_modules() if name]
    try:
        with hooks_removed(handles), running_modules(model) as running:
            output = first_tensor(forward_without_cache(model, inputs))
    except Exception as error:  # noqa: BLE001 - re-raised with where it happened
        raise _ForwardFailure(running[-1] if running else None, error) from error
    return output, outputs


def _gradients(model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at full size (sharded ones gathered: a collective); zeros where none."""
    specs = {name: spec for name, _, spec in named_sharded_parameters(model)}
    grads = {name: p.grad if p.grad is not None else torch.zeros_like(p) for name, p in model.named_parameters()}
    sharded = [name for name in grads if name in specs]
    gathered = unshard_tensors([(grads[name], specs[name]) for name in sharded], group)
    return {**grads, **dict(zip(sharded, gathered, strict=True))}


def _gradient_errors(gradients: dict[str, torch.Tensor], reference: dict[str, nn.Parameter]) -> dict[str, float]:
    """Per parameter: the largest gradient difference, relative to that gradient's scale (at least 1e-3 of the
    largest gradient anywhere, so exactly-zero true gradients do not divide by round-off)."""
    ref_grads = {name: param.grad for name, param in reference.items() if param.grad is not None}
    largest = max((grad.abs().max().item() for grad in ref_grads.values()), default=0.0)
    errors = {}
    for name, grad in gradients.items():
        if name in ref_grads and grad.shape == ref_grads[name].shape:
            scale = max(ref_grads[name].abs().max().item(), 1e-3 * largest, 1e-30)
            errors[name] = (grad - ref_grads[name]).abs().max().item() / scale
    return errors


def _entries_near(name: str | None, planned: Sequence) -> str:
    """The plan entries in and around module `name` (its parent's subtree), for the error message."""
    if not name:
        return ""
    parent = name.rpartition(".")[0]
    near = [entry for entry in planned if not parent or entry.name == parent or entry.name.startswith(parent + ".")]
    if not near:
        return ""
    listed = ", ".join(f"'{entry.name}': '{entry.written_style}'" for entry in near[:6])
    return f"; plan entries there: {listed}{', ...' if len(near) > 6 else ''}"
