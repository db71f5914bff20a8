"""Plan verification: before training, the sharded model must compute what the unsharded model computes.

A wrong split usually still runs and trains, just as a different function. `verify_parallelized` turns that into an
error: it rebuilds the unsharded model from the gathered shards (`full_state_dict`) in a meta-device copy taken
before sharding (`unsharded_skeleton`, which costs no memory), runs one probe batch through both, backpropagates
the same scalar through both, and raises `PlanVerificationError` (one line: the difference, the first module whose
output or the first parameter whose gradient differs, and the plan entries around it) when they disagree.

The reference is a whole unsharded model on every rank for the duration of the check; for a model that does not
fit, turn verification off (`parallelize(..., verify=False)`, `TensorParallelStrategy(verify_plan=False)`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from itertools import chain

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.comm import gather_from_tensor_parallel_region
from tp_train.probe import PROBE_TOKENS, first_line, probe_token_ids
from tp_train.sharding import full_state_dict, named_sharded_parameters, unshard_tensor

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-4}  # relative to the largest reference value
HALF_PRECISION_TOLERANCE = 3e-2


class PlanVerificationError(ValueError):
    """The sharded model computes something other than the unsharded model: the plan is wrong."""


def unsharded_skeleton(model: nn.Module) -> nn.Module:
    """A copy of `model` whose tensors are on the meta device (ties kept): its structure, without its memory."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in chain(model.parameters(), model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def unsharded_reference(skeleton: nn.Module, model: nn.Module, group: ProcessGroup) -> nn.Module:
    """`skeleton` given the sharded `model`'s weights, gathered (a collective), and its buffers."""
    state = full_state_dict(model, group)
    buffers = dict(model.named_buffers(remove_duplicate=False))
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
    example_input: torch.Tensor | None = None,
    tolerance: float | None = None,
) -> dict[str, float]:
    """Checks the sharded `model` against the unsharded `reference` on one probe batch (a collective).

    Compares the outputs, then the gradients of every parameter (sharded ones gathered) after backpropagating the
    same random projection of the output through both. Leaves `model`'s gradients cleared and its mode unchanged.

    Args:
        model: the model after `apply_plan`.
        reference: the unsharded model with the same weights (`unsharded_reference`).
        group: the tensor-parallel group.
        planned: the plan's `PlannedModule`s, to name the entries near a difference.
        example_input: the probe input; default (1, 8) random token ids (a multiple of tp long).
        tolerance: largest relative difference accepted; default 1e-4 in fp32, 3e-2 in half precision.

    Returns:
        {"output": relative output difference, "gradient": largest relative gradient difference}.

    Raises:
        PlanVerificationError: on every rank, when any rank sees a difference beyond `tolerance`.
    """
    # A length every tp divides, for sequence parallelism's split: 8 tokens at tp 1, 2, 4 and 8.
    length = math.lcm(PROBE_TOKENS, dist.get_world_size(group))
    inputs = example_input if example_input is not None else probe_token_ids(reference, length)
    dtype = next(reference.parameters()).dtype
    tolerance = tolerance if tolerance is not None else TOLERANCE.get(dtype, HALF_PRECISION_TOLERANCE)
    modes = {module: module.training for module in chain(model.modules(), reference.modules())}
    model.eval(), reference.eval()
    try:
        ref_output, ref_modules = _forward(reference, inputs)
        weight = torch.randn(ref_output.shape, generator=torch.Generator().manual_seed(0)).to(ref_output)
        (ref_output.float() * weight).sum().backward()
        errors, problem = _compare(model, inputs, group, ref_output, ref_modules, weight, tolerance)
        if problem is None:
            errors["gradient"], problem = _compare_gradients(model, reference, group, tolerance)
    finally:
        for module, mode in modes.items():
            module.train(mode)
        model.zero_grad(set_to_none=True)
    if problem is not None:
        text, suspect = problem
        problem = f"{text}{_entries_near(suspect, planned)}"
    problems: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(problems, problem, group=group)
    reported = next((rank, text) for rank, text in enumerate(problems + ["ok"]) if text)
    if reported[1] != "ok":
        raise PlanVerificationError(
            f"tensor-parallel plan verification failed (rank {reported[0]}): {reported[1]}; fix the plan, or pass "
            f"verify=False to skip this check"
        )
    return errors


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
    except Exception as error:  # noqa: BLE001 - a plan that breaks the forward is reported like a wrong one
        return {}, (f"the sharded model fails on a probe batch ({type(error).__name__}: {first_line(error)})", None)
    output_error = _relative(output, ref_output)
    if output_error <= tolerance:
        return {"output": output_error}, None
    differing = (name for name, ref in ref_modules.items() if _relative(modules.get(name, ref), ref) > tolerance)
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


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) else ()
    return next((value for value in values if isinstance(value, torch.Tensor)), None)


def _forward(model: nn.Module, inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's output, and each module's first tensor output in the order the modules returned."""
    outputs: dict[str, torch.Tensor] = {}

    def record(name):
        def hook(module, args, output):
            tensor = _first_tensor(output)
            if tensor is not None:
                outputs.setdefault(name, tensor.detach())

        return hook

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules() if name]
    try:
        output = _first_tensor(model(inputs))
    finally:
        for handle in handles:
            handle.remove()
    return output, outputs


def _gradients(model: nn.Module, group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Every parameter's gradient at full size (sharded ones gathered: a collective); zeros where none."""
    specs = {name: spec for name, _, spec in named_sharded_parameters(model)}
    gradients = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        gradients[name] = unshard_tensor(grad, specs[name], group) if name in specs else grad
    return gradients


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


def _relative(tensor: torch.Tensor, reference: torch.Tensor) -> float:
    if tensor.shape != reference.shape:
        return 0.0  # a sharded module's local output: not comparable, and not the first difference
    scale = max(reference.abs().max().item(), 1e-30)
    return (tensor.float() - reference.float()).abs().max().item() / scale


def _entries_near(name: str | None, planned: Sequence) -> str:
    """The plan entries in and around module `name` (its parent's subtree), for the error message."""
    if not name:
        return ""
    parent = name.rpartition(".")[0]
    near = [entry for entry in planned if not parent or entry.name == parent or entry.name.startswith(parent + ".")]
    if not near:
        return ""
    listed = ", ".join(f"'{entry.name}': '{entry.style}'" for entry in near[:6])
    return f"; plan entries there: {listed}{', ...' if len(near) > 6 else ''}"
