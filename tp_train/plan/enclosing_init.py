"""A meta-built module's initialiser as its model's own initialisation runs it: the module's `_init_weights` call,
then its enclosing modules' calls, which may set its tensors too. Hugging Face initialises every module, children
before parents (`PreTrainedModel.initialize_weights`), and some parents' branches set their children's tensors
(Qwen3-Next's sparse MoE block draws its router's weight: `init.normal_(module.gate.weight)`). Materialised module by
module, a parent holding no tensors of its own was never initialised, and the router kept `torch.empty`'s memory,
another on every rank (issue 41: qwen3_next, qwen3_5_moe, qwen4_exp through train.py)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from itertools import chain

import torch
import torch.nn as nn
from transformers.initialization import guard_torch_init_functions

from tp_train.plan.meta_init import init_weights_of

INITIALIZED = "_is_hf_initialized"  # Hugging Face's mark: its initialisers leave a tensor carrying it as it is


def initializer_of(root: nn.Module, name: str) -> Callable[[nn.Module], None] | None:
    """`init(module)` for `root`'s submodule `name`, or None where no enclosing model has an `_init_weights`
    (`meta_init.init_weights_of`): the module's own initialiser, then each enclosing module's (innermost first, up
    to `root`) with every real tensor but the module's own marked initialised, so an enclosing call sets this
    module's tensors and leaves the rest (shards already cut, weights already drawn) as they are; meta tensors,
    materialised later, take no values. A tensor tied to another name inside an enclosing module stays marked for
    that module's call: Hugging Face ties after initialising, so the tie's other end's rule (ModernBERT's decoder,
    drawn at the output projections' spread) never reaches it."""
    own = init_weights_of(root, name)
    if own is None:
        return None
    parts = name.split(".") if name else []
    enclosing = [".".join(parts[:depth]) for depth in range(len(parts) - 1, -1, -1)]
    calls = [(parent, init) for parent in enclosing if (init := init_weights_of(root, parent)) is not None]

    def init(module: nn.Module) -> None:
        own(module)
        if not calls:
            return
        opened = {id(tensor) for tensor in chain(module.parameters(recurse=False), module.buffers(recurse=False))}
        others, elsewhere = _split(root, name, opened)
        with _marked(others), guard_torch_init_functions():
            for parent, parent_init in calls:
                inside = f"{parent}." if parent else ""
                tied = [tensor for tensor, names in elsewhere if any(other.startswith(inside) for other in names)]
                with _marked(tied):
                    parent_init(root.get_submodule(parent))

    return init


def _split(root: nn.Module, name: str, opened: set[int]):
    """`root`'s real tensors outside `opened` (ids), and each tensor of `opened` tied to names outside its submodule
    `name`, with those names: one pass over every parameter and buffer, a tied one under each of its names."""
    own = f"{name}." if name else ""
    others: list[torch.Tensor] = []
    elsewhere: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for prefix, sub in root.named_modules(remove_duplicate=False):
        for key, tensor in chain(sub._parameters.items(), sub._buffers.items()):
            if tensor is None:
                continue
            if id(tensor) not in opened:
                if not tensor.is_meta:
                    others.append(tensor)
            elif f"{prefix}." != own:
                elsewhere.setdefault(id(tensor), (tensor, []))[1].append(f"{prefix}.{key}" if prefix else key)
    return others, list(elsewhere.values())


@contextmanager
def _marked(tensors):
    """`tensors` marked initialised for the duration; marks set before are kept."""
    marked = {id(tensor): tensor for tensor in tensors if not getattr(tensor, INITIALIZED, False)}.values()
    for tensor in marked:
        setattr(tensor, INITIALIZED, True)
    try:
        yield
    finally:
        for tensor in marked:
            delattr(tensor, INITIALIZED)
