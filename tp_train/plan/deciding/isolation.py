"""Deciding a plan leaves no trace: the random generators and the model's modules are as they were before.

The group's first rank plans for every rank (`parallelize`), so whatever its probe forwards change would change on
that rank only: a draw from a generator (a module built inside a forward, NumPy's random blocks in BigBird's
attention) puts its stream ahead of the other ranks', and a model that rebuilds its own modules as it runs (BigBird
swaps its attention for another class below a sequence length) would be a different model there. What follows
planning (initialisation, verification, training) then differs between ranks. So planning runs inside
`planning_isolated` on every rank that plans, and the ranks that do not are as if they had.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import numpy as np
import torch
import torch.nn as nn

# The containers nn.Module keeps in its __dict__ whose contents a forward may replace (a submodule swapped for
# another, a parameter or buffer rebound): copied, so that the copies can be put back.
_CONTAINERS = ("_modules", "_parameters", "_buffers")


@contextmanager
def planning_isolated(model: nn.Module) -> Iterator[None]:
    """The block runs with Python's, NumPy's and torch's generators (CPU and every initialised CUDA device) saved,
    and `model`'s modules' attributes saved, and finds all of them restored when it ends, however it ends."""
    with ExitStack() as stack:
        stack.enter_context(random_states_kept())
        stack.enter_context(modules_kept(model))
        yield


@contextmanager
def random_states_kept() -> Iterator[None]:
    """Python's, NumPy's and torch's global generators as they were before the block, after it."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


@contextmanager
def modules_kept(model: nn.Module) -> Iterator[None]:
    """Every module of `model` with its class and attributes (its submodules, parameters and buffers as bound, its
    settings) as they were before the block, after it. Tensors' contents are not copied: a probe forward runs in
    eval mode and does not write into them."""
    saved = []
    for module in model.modules():
        attributes = dict(vars(module))
        for name in _CONTAINERS:
            if name in attributes:
                attributes[name] = dict(attributes[name])
        saved.append((module, module.__class__, attributes))
    try:
        yield
    finally:
        for module, cls, attributes in saved:
            module.__class__ = cls
            containers = {name: vars(module).get(name) for name in _CONTAINERS}
            vars(module).clear()
            vars(module).update(attributes)
            for name, contents in containers.items():  # the same dict objects, refilled: hooks may hold them
                if contents is not None and name in attributes:
                    contents.clear()
                    contents.update(attributes[name])
                    vars(module)[name] = contents
