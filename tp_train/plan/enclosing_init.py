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

import torch.nn as nn

from tp_train.plan.meta_init import init_weights_of

INITIALIZED = "_is_hf_initialized"  # Hugging Face's mark: its initialisers leave a tensor carrying it as it is


def initializer_of(root: nn.Module, name: str) -> Callable[[nn.Module], None] | None:
    """`init(module)` for `root`'s submodule `name`, or None where no enclosing model has an `_init_weights`
    (`meta_init.init_weights_of`): the module's own initialiser, then each enclosing module's (innermost first, up
    to `root`) with every real tensor but the module's own marked initialised, so an enclosing call sets this
    module's tensors and leaves the rest (shards already cut, weights already drawn) as they are; meta tensors,
    materialised later, take no values."""
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
        with _others_marked(root, opened):
            for parent, parent_init in calls:
                parent_init(root.get_submodule(parent))

    return init


@contextmanager
def _others_marked(root: nn.Module, opened: set[int]):
    """Every real tensor of `root` outside `opened` (ids) marked initialised for the duration (Hugging Face's own
    guard on `torch.nn.init` too, for initialisers that call torch's directly); marks set before are kept."""
    from transformers.initialization import guard_torch_init_functions

    marked = [
        tensor
        for tensor in chain(root.parameters(), root.buffers())
        if not tensor.is_meta and id(tensor) not in opened and not getattr(tensor, INITIALIZED, False)
    ]
    for tensor in marked:
        setattr(tensor, INITIALIZED, True)
    try:
        with guard_torch_init_functions():
            yield
    finally:
        for tensor in marked:
            delattr(tensor, INITIALIZED)
