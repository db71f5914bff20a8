"""Building a model on the meta device (`deferred_init`), and giving each of its modules real storage and initial
weights (`materialize`): shared by applying a plan (each rank's shards) and by the planner's probe (a CPU copy to run a
probe batch through)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.nn.modules import module as module_hooks
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map_only

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
KEPT = "_tp_kept_values"  # a module's attribute: the names of its tensors whose constructed values were kept


class _KeptValuesMode(TorchFunctionMode):
    """`torch.device("meta")` for every factory without a device, except `VALUE_FACTORIES` of at most
    `KEPT_VALUES_LIMIT` elements, which are built on the CPU. An operation mixing kept and meta tensors computes on
    the meta device (its value depends on one that does not exist yet), and one writing such a value into a kept
    tensor leaves it as it is: Zamba's `_init_weights`, run by Hugging Face's `post_init` while the model is built,
    copies a meta draw into its kept `dt_proj_bias`; `materialize` runs the initialiser again on real tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DEVICE_FACTORIES and kwargs.get("device") is None:
            shape = func(*args, **{**kwargs, "device": "meta"})
            if func not in VALUE_FACTORIES or shape.numel() > KEPT_VALUES_LIMIT:
                return shape
            kwargs = {**kwargs, "device": "cpu"}
        tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(tensor.is_meta for tensor in tensors) and not all(tensor.is_meta for tensor in tensors):
            if getattr(func, "__name__", "").endswith("_") and isinstance(args[0], torch.Tensor):
                if not args[0].is_meta:  # an in-place write of a value not known yet
                    return args[0]
            args, kwargs = tree_map_only(torch.Tensor, lambda tensor: tensor.to("meta"), (args, kwargs))
        return func(*args, **kwargs)


@contextmanager
def deferred_init() -> Iterator[None]:
    """Builds modules on the meta device (shapes only: their weights are drawn per rank's shard by `materialize`),
    except the tensors whose values the constructor computes from its arguments (`VALUE_FACTORIES`, up to
    `KEPT_VALUES_LIMIT` elements), which stay real: a value no `_init_weights` or `reset_parameters` redoes (Apertus'
    xIELU scalars, Data2VecText's head bias, Falcon-H1's muP vector) is then what the model built on a real device
    holds, not `torch.empty`'s memory (issue 41). `materialize` still runs each such module's initialiser, as Hugging
    Face's `post_init` would after its constructor."""

    def tag(module: nn.Module, name: str, tensor):
        if tensor is not None and not tensor.is_meta:
            module.__dict__.setdefault(KEPT, set()).add(name)

    handles = [
        module_hooks.register_module_parameter_registration_hook(tag),
        module_hooks.register_module_buffer_registration_hook(tag),
    ]
    try:
        with _KeptValuesMode():
            yield
    finally:
        for handle in handles:
            handle.remove()


def init_weights_of(root: nn.Module, name: str):
    """The weight initialiser of the innermost module enclosing `root`'s submodule `name` that has one (a Hugging
    Face model's `_init_weights`), or None: a model planned from a wrapper (a LightningModule holding a Hugging Face
    model the auto-planner plans through) initialises each module as the model itself would. Its rotary
    embeddings' computed buffers (StableLM's `inv_freq`, no `reset_parameters`) are recomputed so, as Hugging
    Face's own meta-device loading does (issue 41)."""
    parts = name.split(".") if name else []
    for depth in range(len(parts), -1, -1):
        owner = root.get_submodule(".".join(parts[:depth]))
        init_weights = getattr(owner, "_init_weights", None)
        if callable(init_weights):
            return init_weights
    return None


def materialize(name: str, module: nn.Module, device: torch.device, materialized: dict, init_weights=None) -> None:
    """Gives `module`'s own meta-device tensors storage on `device` and initialises them: `init_weights(module)`
    when given, else `module.reset_parameters()`. `materialized` maps each meta tensor given storage before (the
    tensor itself, which the key keeps alive: an id, once its tensor is freed, is another tensor's) to its real one,
    so a tensor tied across modules is materialised once. A tensor whose constructed value `deferred_init` kept
    moves to `device` with its value, and its module is initialised as if built there."""
    kept = module.__dict__.pop(KEPT, ())
    fresh = bool(kept)
    drawn = False  # a meta tensor given storage, which only an initialiser can fill
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
                drawn = drawn or tensor.is_meta
            tensors[key] = materialized[tensor]
    if not fresh:
        return
    if init_weights is not None:
        init_weights(module)
        return
    if not hasattr(module, "reset_parameters"):
        if not drawn:  # only kept values: they are what its constructor computed
            return
        raise ValueError(
            f"module '{name}' ({type(module).__name__}) was built on the meta device but has no reset_parameters() "
            f"to initialise it; define one, or build the model on a real device"
        )
    module.reset_parameters()
