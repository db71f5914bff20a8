"""The parallel code on fake ranks: torch's fake process group (backend "fake", whose collectives move nothing) with
fake tensors (which hold no data), as the step simulator runs it (`tp_train.tools.simulate`).

The model's tensors may be fake; the few values that steer the control flow cannot be: a failure flag that is read,
a generator state that is set, a decision sent from the first rank. Those are made with `real_values()`, so they are
real host tensors under a fake mode (a collective on the fake group leaves each rank's own), and a decision on a fake
group is taken by each rank itself (`fake_group`): in a simulation the one process is every rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed import ProcessGroup

FAKE_BACKEND = "fake"


def fake_group(group: ProcessGroup | None = None) -> bool:
    """Whether `group` (default: the world) is torch's fake process group."""
    return str(dist.get_backend(group)) == FAKE_BACKEND


@contextmanager
def real_values() -> Iterator[None]:
    """Tensors made inside are real even under a fake tensor mode (no cost where none is active)."""
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is None:
        yield
        return
    with unset_fake_temporarily():
        yield
