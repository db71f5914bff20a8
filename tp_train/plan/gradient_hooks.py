"""Gradient hooks on parameters, recorded on the module (`tp_gradient_hooks`) so that `keep_gradient_hooks` can put
them back on the parameters a wrapper such as FSDP2 replaces them with."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

GradientHook = Callable[[torch.Tensor], torch.Tensor]
# What a hook registered `once` does, by name.
SUM_REPLICAS = "sum over the ranks holding a replicated section"
SUM_OVER_RANKS = "sum over the tensor-parallel group"


def register_gradient_hook(module: nn.Module, name: str, hook: GradientHook, once: str | None = None) -> None:
    """`hook` on the gradient of `module`'s own parameter `name`, now and on any parameter replacing it; also on a
    frozen parameter, so that one frozen before sharding and unfrozen later still has its gradient summed. A hook
    registered `once` (a name for what it does: "sum over replicas") is not added again to a parameter that already
    has it: a parameter tied between modules planned alike (Zamba's shared attention in every hybrid layer) gets its
    gradient summed once, not once per module."""
    param = getattr(module, name)
    if once is not None:
        done = param.__dict__.setdefault("tp_gradient_hooks_once", set())
        if once in done:
            return
        done.add(once)
    _register(param, hook)
    module.__dict__.setdefault("tp_gradient_hooks", {}).setdefault(name, []).append(hook)


def keep_gradient_hooks(root: nn.Module) -> None:
    """After the parameters of `root` were replaced (FSDP2): before each forward of a module with recorded hooks,
    the parameters it then holds (FSDP2's unsharded ones) get those hooks, once per parameter object."""
    for module in root.modules():
        if module.__dict__.get("tp_gradient_hooks"):
            module.register_forward_pre_hook(_rehook)


def _rehook(module: nn.Module, args) -> None:
    for name, hooks in module.__dict__["tp_gradient_hooks"].items():
        param = getattr(module, name)
        for hook in hooks:
            if hook not in getattr(param, "tp_gradient_hooks", ()):
                _register(param, hook)


@contextmanager
def requiring_grad(params: Iterable[torch.Tensor], wanted: Callable[[torch.Tensor], bool]) -> Iterator[None]:
    """Each of `params` requiring gradients as `wanted(param)` says for the duration, as it did before after."""
    flags = {param: param.requires_grad for param in params}
    try:
        for param in flags:
            param.requires_grad_(wanted(param))
        yield
    finally:
        for param, flag in flags.items():
            param.requires_grad_(flag)


def _register(param: torch.Tensor, hook: GradientHook) -> None:
    """`param.register_hook(hook)`, also when `param` is frozen (torch refuses a hook on a tensor that does not
    require grad, but keeps one across `requires_grad` changes), recorded in `param.tp_gradient_hooks`."""
    with requiring_grad([param], lambda _: True):
        param.register_hook(hook)
    param.__dict__.setdefault("tp_gradient_hooks", []).append(hook)
