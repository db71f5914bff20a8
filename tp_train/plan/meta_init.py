"""Building a model on the meta device (`deferred_init`), and giving each of its modules real storage and initial
weights (`materialize`): shared by applying a plan (each rank's shards) and by the planner's probe (a CPU copy to run a
probe batch through)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

from tp_train.parallel.pipeline.split import skipped
from tp_train.plan.init_record import (
    INIT_RECORDS,
    RECIPE,
    TARGET,
    InitRecorder,
    computed_value,
    recording_skipped_inits,
    replay,
    replayable,
    written_tensor,
)

# Factories whose values their arguments decide (no random draw, no uninitialised memory): what a constructor computes
# with them (xIELU's scalars, a bias's zeros, a rotary embedding's frequencies, Falcon-H1's muP vector) is kept.
VALUE_FACTORIES = frozenset(
    getattr(torch, name) for name in (
        "arange", "as_tensor", "asarray", "eye", "full", "linspace", "logspace", "ones", "range", "scalar_tensor",
        "tensor", "tril_indices", "triu_indices", "zeros", "bartlett_window", "blackman_window", "hamming_window",
        "hann_window", "kaiser_window",
    )
)  # fmt: skip
KEPT_VALUES_LIMIT = 1 << 20  # elements: biases, norms, scalars and buffers; never a weight matrix of a real model
_DEVICE_FACTORIES = frozenset(torch.utils._device._device_constructors())  # what torch.device("meta") places
_DATA_GETTER = torch.Tensor.data.__get__  # `tensor.data`, an alias whose writes are the tensor's
KEPT = "_tp_kept_values"  # a module's attribute: the names of its tensors whose constructed values were kept
COMPUTED_VALUES = "computed values"  # in `materialize`'s `materialized`: the values records read, by meta tensor
# In `materialized` (`materializing`'s): the draws' base seed, and each meta tensor's name in the whole model.
BASE_SEED, TENSOR_NAMES = "base seed", "tensor names"
SESSION_KEYS = (BASE_SEED, TENSOR_NAMES, COMPUTED_VALUES)  # what every `materialized` of one model shares


class _KeptValuesMode(TorchFunctionMode):
    """`torch.device("meta")` for every factory without a device, except `VALUE_FACTORIES` of at most
    `KEPT_VALUES_LIMIT` elements, which are built on the CPU. An operation mixing kept and meta tensors computes on
    the meta device (its value depends on one that does not exist yet), and one writing such a value into a kept
    tensor leaves it as it is: Zamba's `_init_weights`, run by Hugging Face's `post_init` while the model is built,
    copies a meta draw into its kept `dt_proj_bias`; `materialize` runs the initialiser again on real tensors. Every
    write to a meta tensor is recorded (`recorder`), to be made again once the tensor exists."""

    def __init__(self, recorder: InitRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DEVICE_FACTORIES and kwargs.get("device") is None:
            placed = {**kwargs, "device": "meta"}
            shape = func(*args, **placed)
            if func not in VALUE_FACTORIES or shape.numel() > KEPT_VALUES_LIMIT:
                self.recorder.computed(func, args, placed, shape)  # a draw, made again where it is read
                return shape
            kwargs = {**kwargs, "device": "cpu"}
        written = written_tensor(func, args, kwargs)
        if written is not None and written.is_meta:
            self.recorder.record(func, args, kwargs, written)
        given = (args, kwargs)
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(tensor.is_meta for tensor in tensors) and not all(tensor.is_meta for tensor in tensors):
            if written is not None and not written.is_meta:  # an in-place write of a value not known yet
                return written
            args, kwargs = tree_map_only(torch.Tensor, lambda tensor: tensor.to("meta"), (args, kwargs))
        result = func(*args, **kwargs)
        if func == _DATA_GETTER and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            self.recorder.alias(args[0], result)  # `p.data.normal_()` writes into p
        elif written is None:
            self.recorder.computed(func, *given, result)
        return result


@contextmanager
def deferred_init() -> Iterator[None]:
    """Builds modules on the meta device (shapes only: their weights are drawn per rank's shard by `materialize`),
    except the tensors whose values the constructor computes from its arguments (`VALUE_FACTORIES`, up to
    `KEPT_VALUES_LIMIT` elements), which stay real: a value no `_init_weights` or `reset_parameters` redoes (Apertus'
    xIELU scalars, Data2VecText's head bias, Falcon-H1's muP vector) is then what the model built on a real device
    holds, not `torch.empty`'s memory (issue 41). `materialize` still runs each such module's initialiser, as Hugging
    Face's `post_init` would after its constructor."""

    recorder = InitRecorder()

    def tag(module: nn.Module, name: str, tensor):
        if tensor is not None and not tensor.is_meta:
            module.__dict__.setdefault(KEPT, set()).add(name)
        elif tensor is not None:  # the writes made to it from here on (and before, as the same tensor)
            writes = recorder.record_of(tensor)
            module.__dict__.setdefault(INIT_RECORDS, {})[name] = writes
            if not writes and hasattr(tensor, RECIPE):  # registered as drawn (a buffer of `torch.randn`): drawn again
                writes.append((torch.Tensor.copy_, (TARGET, computed_value(tensor)), {}))

    handles = [
        module_hooks.register_module_parameter_registration_hook(tag),
        module_hooks.register_module_buffer_registration_hook(tag),
    ]
    try:
        with _KeptValuesMode(recorder), recording_skipped_inits(recorder):
            yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass(frozen=True)
class ModuleInitializer:
    """How one module of a model built on meta is initialised as an eager build would: `own`, the weight initialiser of
    the innermost enclosing model that has one (a Hugging Face model's `_init_weights`), or None (the module's
    `reset_parameters`); `enclosing`, each enclosing module with its own initialiser, innermost first, whose rules
    may reach into this module (GPT-2's attention rescaling its `c_proj`), as Hugging Face's `post_init` applies them,
    children before parents. Used for the tensors whose recorded initialisation cannot be made again
    (`tp_train.plan.init_record`)."""

    own: Callable[[nn.Module], None] | None = None
    enclosing: tuple[tuple[nn.Module, Callable[[nn.Module], None]], ...] = ()


def initializer(root: nn.Module, name: str) -> ModuleInitializer:
    """The initialisers of `root`'s submodule `name` (`ModuleInitializer`): a model planned from a wrapper (a
    LightningModule holding a Hugging Face model the auto-planner plans through) initialises each module as the model
    itself would. Its rotary embeddings' computed buffers (StableLM's `inv_freq`, no `reset_parameters`) are
    recomputed so, as Hugging Face's own meta-device loading does (issue 41)."""
    parts = name.split(".") if name else []
    owners = [root.get_submodule(".".join(parts[:depth])) for depth in range(len(parts), -1, -1)]
    holders = [owner for owner in owners if callable(getattr(owner, "_init_weights", None))]
    if not holders:
        return ModuleInitializer()
    enclosing = []
    for position, owner in enumerate(owners[1:], start=1):
        holder = next((holder for holder in owners[position:] if holder in holders), None)
        if holder is not None:
            enclosing.append((owner, holder._init_weights))
    return ModuleInitializer(holders[0]._init_weights, tuple(enclosing))


def materializing(model: nn.Module, skip: Collection[str] = ()) -> dict:
    """A new `materialized` for `materialize` over `model`'s modules. Each tensor's draws are keyed by its name in
    `model` (a tied one's first) and one base seed taken here from the default generator: a rank that materialises
    only some of the modules (its pipeline stages) draws each of them as one process materialising all of them does,
    whichever others it skips (`skip`: they count for names, not for whether a seed is drawn)."""
    names: dict[torch.Tensor, str] = {}
    drawing = False
    for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if tensor is not None and tensor.is_meta:
            names.setdefault(tensor, name)
            drawing = drawing or not skipped(name.rpartition(".")[0], skip)
    base = int(torch.randint(2**62, (1,))) if drawing else 0
    return {BASE_SEED: base, TENSOR_NAMES: names, COMPUTED_VALUES: {}}


@contextmanager
def _keyed_draws(materialized: dict, name: str, device: torch.device) -> Iterator[None]:
    """The default generators (the CPU's and `device`'s) seeded from the base seed and `name` for the duration, then
    set back: the draws under it depend on nothing drawn before. (The generators themselves, not `torch.manual_seed`
    and `fork_rng`, which visit every backend: a tenth of the time, once per tensor.)"""
    seed = (materialized.get(BASE_SEED, 0) + zlib.crc32(name.encode())) % 2**63
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators.append(torch.cuda.default_generators[device.index if device.index is not None else 0])
    states = [generator.get_state() for generator in generators]
    for generator in generators:
        generator.manual_seed(seed)
    try:
        yield
    finally:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)


def materialize(
    name: str, module: nn.Module, device: torch.device, materialized: dict, init: ModuleInitializer | None = None
) -> None:
    """Gives `module`'s own meta-device tensors storage on `device` and initialises them as an eager build would:
    the writes its construction made to each (`tp_train.plan.init_record`: `reset_parameters`, the model's
    `self.apply(init)` and Hugging Face's `post_init` rules, a scaled `c_proj` loop, a time-step bias computed from a
    draw) made again on the whole tensor. A tensor whose writes cannot be is initialised by `init.own(module)` (else
    `module.reset_parameters()`), then by the enclosing models' rules writing to it only. `materialized` maps each
    meta tensor given storage before (the tensor itself, which the key keeps alive: an id, once its tensor is freed,
    is another tensor's) to its real one, so a tensor tied across modules is materialised once. A tensor whose
    constructed value `deferred_init` kept moves to `device` with its value, and its module is initialised as if
    built there."""
    init = init or ModuleInitializer()
    kept = module.__dict__.pop(KEPT, ())
    records = module.__dict__.pop(INIT_RECORDS, {})
    fresh = bool(kept)
    drawn: dict[str, torch.Tensor] = {}  # meta tensors given storage here, which only an initialiser can fill
    origins: dict[str, torch.Tensor] = {}  # the meta tensor each of `drawn` replaces
    for tensors in (module._parameters, module._buffers):
        for key, tensor in tensors.items():
            if tensor is None or not (tensor.is_meta or key in kept and tensor.device != device):
                continue
            if tensor not in materialized:
                real = torch.empty_like(tensor, device=device) if tensor.is_meta else tensor.detach().to(device)
                if isinstance(tensor, nn.Parameter):
                    real = nn.Parameter(real, requires_grad=tensor.requires_grad)
                materialized[tensor] = real
                fresh = True
                if tensor.is_meta:
                    drawn[key], origins[key] = real, tensor
            tensors[key] = materialized[tensor]
    if not fresh:
        return
    unrecorded = {key: tensor for key, tensor in drawn.items() if not replayable(records.get(key))}
    if kept or unrecorded:
        with _keyed_draws(materialized, name, device):
            _initialise(name, module, init, unrecorded)
    computed = materialized.setdefault(COMPUTED_VALUES, {})  # the draws records read, shared by this materialisation
    names = materialized.get(TENSOR_NAMES, {})
    for key, tensor in drawn.items():
        if key not in unrecorded:
            with _keyed_draws(materialized, names.get(origins[key], f"{name}.{key}"), device):
                replay(records[key], tensor, computed)


def materialize_remaining(root: nn.Module, device: torch.device, skip: Collection[str] = ()) -> None:
    """Gives storage to what of `root` is still on the meta device (the modules outside its planned models: a
    LightningModule's own layers), each module initialised as an eager build would (`materialize`), and leaves every
    tensor that has storage as it is. Lightning's `to_empty` on the root then `reset_parameters` everywhere drew the
    planned models' weights again (their replayed initialisation lost, each rank's shards drawn apart). The modules
    named in `skip` (another pipeline stage's) stay on the meta device."""
    materialized = materializing(root, skip)
    for name, module in root.named_modules():
        if not skipped(name, skip):
            materialize(name, module, device, materialized, initializer(root, name))


def _initialise(name: str, module: nn.Module, init: ModuleInitializer, tensors: dict[str, torch.Tensor]) -> None:
    """`module`'s own initialiser, then the enclosing models' rules writing to `tensors` only."""
    if init.own is not None:
        init.own(module)
    elif hasattr(module, "reset_parameters"):
        module.reset_parameters()
    elif tensors:
        raise ValueError(
            f"module '{name}' ({type(module).__name__}) was built on the meta device but has no reset_parameters() "
            f"to initialise it, and its constructor's initialisation of {sorted(tensors)} cannot be made again; "
            f"define reset_parameters(), or build the model on a real device"
        )
    if tensors and init.enclosing:
        outermost = init.enclosing[-1][0]
        others = {_storage(t) for t in [*outermost.parameters(), *outermost.buffers()] if not t.is_meta}
        with _WritesOnly(protected=others - {_storage(tensor) for tensor in tensors.values()}):
            for owner, rule in init.enclosing:
                rule(owner)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _WritesOnly(TorchFunctionMode):
    """Keeps in-place writes from the `protected` storages (views of them included): an enclosing model's initialiser,
    run for one module's sake, leaves the rest of the model as it is (its scratch tensors, a rejection sampler's
    draws, are written as usual)."""

    def __init__(self, protected: set[int]) -> None:
        super().__init__()
        self.protected = protected

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = written_tensor(func, args, kwargs)
        if target is not None and not target.is_meta and _storage(target) in self.protected:
            return target
        return func(*args, **kwargs)
