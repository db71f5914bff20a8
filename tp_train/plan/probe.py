"""One probe forward of a model, for the auto-planner: which modules ran, in what order, on which input and with
which output, and the autograd dataflow between them; run on the model itself, or on a materialised copy of a model
on the meta device; and the tensor caches a module keeps of what its parameters compute, emptied around a probe."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tp_train.errors import first_line
from tp_train.plan.gradient_hooks import requiring_grad
from tp_train.plan.meta_init import initializer, materialize
from tp_train.plan.probe_input import EXAMPLE_INPUT_HINT, ProbeInput, forward_argument
from tp_train.plan.styles import pointwise_conv_shape


@dataclass
class ModuleCall:
    order: int  # position in the probe forward, by entry
    input: torch.Tensor | None = None
    output: torch.Tensor | None = None
    calls: int = 0
    shapes: set = field(default_factory=set)  # of its tensor outputs, over its calls
    inputs: list = field(default_factory=list)  # first input of each call, in order (None where not a tensor)
    outputs: list = field(default_factory=list)  # first tensor output of each call, in order (None where none)


def channels_last(module: nn.Module, tensor):
    """`tensor` as the planner reads a module's input or output: with the features last. A 1x1 Conv2d's (N, C, H, W)
    becomes an (N, H, W, C) view (a matmul over its channels, like a Linear's); anything else is as it is."""
    pointwise = isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and pointwise_conv_shape(module) is not None
    return tensor.movedim(1, -1) if pointwise else tensor


def channels_first(module: nn.Module, tensor):
    """The inverse of `channels_last`: a planner's view of a 1x1 Conv2d's output back to the (N, C, H, W) it runs."""
    pointwise = isinstance(tensor, torch.Tensor) and tensor.dim() == 4 and pointwise_conv_shape(module) is not None
    return tensor.movedim(-1, 1) if pointwise else tensor


def trace_calls(model: nn.Module, inputs: ProbeInput) -> dict[str, ModuleCall]:
    """Every module called in one forward: entry order, call count, and the first input and first tensor output of
    each call (`input` and `output`: the last call's), with autograd history.

    Raises:
        ValueError: one line naming the model, the probe's input and the innermost module whose forward raised."""
    calls: dict[str, ModuleCall] = {}

    def enter(name, module, args):
        calls.setdefault(name, ModuleCall(order=len(calls))).calls += 1

    def leave(name, module, args, output):
        call = calls[name]
        call.input = channels_last(module, args[0]) if args and isinstance(args[0], torch.Tensor) else None
        call.output = channels_last(module, output) if isinstance(output, torch.Tensor) else None
        if call.output is not None:
            call.shapes.add(tuple(call.output.shape))
        call.inputs.append(call.input)
        call.outputs.append(call.output)
        # The model goes on from the recorded view (a 1x1 conv's channels-last one), so the dataflow that later
        # modules' inputs show passes through it.
        return channels_first(module, call.output) if call.output is not output else None

    named = [(name, module) for name, module in model.named_modules() if name]
    handles = [module.register_forward_pre_hook(partial(enter, name)) for name, module in named]
    handles += [module.register_forward_hook(partial(leave, name)) for name, module in named]
    try:
        with hooks_removed(handles), torch.enable_grad(), running_modules(model) as running:
            forward_without_cache(model, inputs)
    except Exception as error:  # noqa: BLE001 - any failure of the probe is reported as one line
        where = f" in the forward of '{running[-1]}'" if running else ""
        raise ValueError(
            f"the auto-planner could not run {type(model).__name__} on its probe input ({inputs.describe(model)})"
            f"{where}: {first_line(error)}; for {forward_argument(model)}, {EXAMPLE_INPUT_HINT}"
        ) from error
    return calls


def foreign_readers(model: nn.Module, inputs: ProbeInput, parameter: nn.Parameter) -> set[str]:
    """The modules that, in one forward of `model` on `inputs`, read `parameter` in their own forward (innermost
    running) without holding it themselves: a torch function took it and returned a tensor with autograd history
    (Perceiver's embedding decoder multiplies by `embedding_layer.weight.t()`; a shape or a dtype read is no use of
    it). A module's weight split by a style reaches only the module's own forward as a whole; these read a shard."""
    holders = {name for name, module in model.named_modules() if any(p is parameter for p in module.parameters(False))}
    found: set[str] = set()

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            read = any(arg is parameter for arg in tree_leaves((args, kwargs)))
            where = running[-1] if running else ""  # "": the model's own forward
            history = any(isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in tree_leaves(result))
            if read and where not in holders and history:
                found.add(where)
            return result

    with torch.enable_grad(), running_modules(model) as running, Reads():
        forward_without_cache(model, inputs)
    return found


def forward_without_cache(model: nn.Module, inputs: ProbeInput | torch.Tensor):
    """`model` on `inputs` (a `ProbeInput`, or one tensor), without a generation cache (`ProbeInput.__call__`)."""
    return ProbeInput.of(inputs)(model)


@contextmanager
def running_modules(model: nn.Module) -> Iterator[list[str]]:
    """A list that holds, during a forward of `model`, the names of the modules whose forward has begun and not
    returned, outermost first; after a forward that raised, it still holds them: its last is where it failed."""
    running: list[str] = []

    def leave(name, module, args, output):
        while running and running.pop() != name:
            pass

    named = [(name, module) for name, module in model.named_modules() if name]
    handles = [
        module.register_forward_pre_hook(lambda _, __, name=name: running.append(name)) for name, module in named
    ]
    handles += [module.register_forward_hook(partial(leave, name)) for name, module in named]
    with hooks_removed(handles):
        yield running


@contextmanager
def hooks_removed(handles: list) -> Iterator[None]:
    """Removes the hook `handles` when the block ends, however it ends."""
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def producers_of(tensor: torch.Tensor | None, outputs: dict[int, str]) -> tuple[set[str], list[nn.Parameter]]:
    """The modules whose outputs `tensor` was computed from, walking its autograd graph back to them and not beyond
    (`outputs` maps id(output.grad_fn) to the module's name), and the parameters used on the way."""
    found, params = set(), []
    stack = [tensor.grad_fn] if tensor is not None and tensor.grad_fn is not None else []
    seen = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if id(node) in outputs:
            found.add(outputs[id(node)])
        elif hasattr(node, "variable"):  # AccumulateGrad: a leaf, i.e. a parameter
            params.append(node.variable)
        else:
            stack.extend(next_node for next_node, _ in node.next_functions)
    return found, params


def producers_of_calls(tensors: list, outputs: dict[int, str]) -> tuple[set[str], list[nn.Parameter]]:
    """`producers_of` over several tensors (a module's input at each of its calls): the union of their producers and
    of the parameters used on the way, each parameter once."""
    found, params = set(), {}
    for tensor in tensors:
        names, used = producers_of(tensor, outputs)
        found |= names
        params.update((id(param), param) for param in used)
    return found, list(params.values())


def split_sizes(output: torch.Tensor | None, consumer_input: torch.Tensor | None) -> tuple[int, ...] | None:
    """The sizes `output` was cut into along its last dimension on the way to `consumer_input` (a `split` with
    unequal sizes, e.g. litgpt's `qkv.split((q, k, v), dim=-1)`, also after an element-wise step such as DBRX's
    `clamp`), read off the autograd graph; None when it was not. The sizes are a candidate only: the planner keeps
    them if perturbing each rank's share moves only that rank's share of the consumer."""
    target = getattr(output, "grad_fn", None)
    stack = [consumer_input.grad_fn] if getattr(consumer_input, "grad_fn", None) is not None else []
    seen, alive = set(), []  # the visited nodes are kept alive, so their ids stay theirs
    while stack and target is not None:
        node = stack.pop()
        if node is None or id(node) in seen or node is target:
            continue
        seen.add(id(node))
        alive.append(node)
        parents = [next_node for next_node, _ in node.next_functions]
        if type(node).__name__ == "SplitWithSizesBackward0" and _through_elementwise(parents, target):
            dim = node._saved_dim - 2**64 if node._saved_dim >= 2**63 else node._saved_dim  # saved as unsigned
            if dim in (-1, output.dim() - 1):
                return tuple(node._saved_split_sizes)
        stack.extend(parents)
    return None


def _through_elementwise(parents: list, target, steps: int = 3) -> bool:
    """Whether `target` is among `parents`, or reached from them through up to `steps` nodes with one input from the
    graph each (a clamp, a scaling: element-wise, so the split's sizes are the output's)."""
    for _ in range(steps + 1):
        if target in parents:
            return True
        inputs = [node for node in parents if node is not None and type(node).__name__ != "AccumulateGrad"]
        if len(inputs) != 1:
            return False
        parents = [next_node for next_node, _ in inputs[0].next_functions]
    return False


@contextmanager
def probe_copy(model: nn.Module) -> Iterator[nn.Module]:
    """`model` itself (in eval mode, its parameters requiring gradients so the forward records its dataflow), or,
    for a model on the meta device, a copy materialised on the CPU; the global RNG and its tensor caches
    (`tp_train.plan.probe`) are left as they were."""

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            probe, materialized = copy.deepcopy(model), {}
            for name, module in probe.named_modules():
                materialize(name, module, torch.device("cpu"), materialized, initializer(probe, name))
        else:
            probe = model
        with requiring_grad(probe.parameters(), torch.is_floating_point), eval_mode(probe), caches_kept(probe):
            yield probe


@contextmanager
def eval_mode(*modules: nn.Module) -> Iterator[None]:
    """`modules` in eval mode for the duration (a probe sees no dropout), each submodule's own mode restored after."""
    training = {sub: sub.training for module in modules for sub in module.modules()}
    for module in modules:
        module.eval()
    try:
        yield
    finally:
        for sub, mode in training.items():
            sub.train(mode)


# Caches a module keeps of what its parameters compute (LeViT's `attention_bias_cache`): a probe empties them and
# restores them, and a module whose parameters a plan splits has them emptied, to compute them from its shards.


def tensor_caches(module: nn.Module, recurse: bool = True) -> list[dict]:
    """The dict attributes of `module` (and of its submodules) whose values are all tensors, empty ones included."""
    return [
        value
        for sub in (module.modules() if recurse else (module,))
        for key, value in vars(sub).items()
        if not key.startswith("_")
        and isinstance(value, dict)
        and all(isinstance(item, torch.Tensor) for item in value.values())
    ]


@contextmanager
def caches_kept(module: nn.Module) -> Iterator[None]:
    """`module`'s tensor caches empty for the block (a probe forward computes them, its dataflow recorded), and as
    they were before after it."""
    saved = [(cache, dict(cache)) for cache in tensor_caches(module)]
    for cache, _ in saved:
        cache.clear()
    try:
        yield
    finally:
        for cache, contents in saved:
            cache.clear()
            cache.update(contents)
