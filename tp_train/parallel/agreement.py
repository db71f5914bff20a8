"""Ending a block of collective work on every rank of a group together, when one rank fails inside it.

A rank that raises between two collectives leaves the others waiting in the next one until the process group's
timeout (minutes): each waits in a different collective. Inside `failures_agreed(group)`, every collective that
tp_train issues (`tp_train.parallel.collectives`, the gathers of `tp_train.parallel.sharding`) is preceded by a
one-element all-reduce of a failure flag: a rank that raised contributes 1 to the next such flag instead of joining
the collective it skipped, so the others stop there too. The block then ends on every rank with the first failing
rank's error (same type, same message), exchanged at one fixed point. Outside such a block `before_collective` costs
one list test.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from tp_train.parallel.fake_ranks import real_values

# The groups of the `failures_agreed` blocks running now, innermost last (a dynamic scope: entered and left by the
# block, never configured from outside).
_agreeing: list[ProcessGroup] = []


class _PeerFailed(BaseException):
    """Another rank of the agreeing group raised inside the block; its error follows at the block's end. Not an
    `Exception`, so that no `except Exception` inside the block (a check that records a failure and goes on) takes
    it for an error of this rank's own."""


def before_collective() -> None:
    """Call right before issuing a collective: inside a `failures_agreed` block, stops here (raising) when another
    rank has failed, instead of waiting in a collective that rank will never join."""
    if _agreeing and not torch.compiler.is_compiling():
        if _any_rank_failed(_agreeing[-1], failed=False):
            raise _PeerFailed


@contextmanager
def failures_agreed(group: ProcessGroup) -> Iterator[None]:
    """Runs the block on every rank of `group`; when it raises on any rank, it raises on every rank the first
    failing rank's error (same type and message; a type that cannot be rebuilt from its message becomes a
    RuntimeError naming it). Every collective in the block must go through `before_collective`, and the block
    must not catch an error that crossed one of them. A block inside another block on the same group is part of it."""
    if dist.get_world_size(group) == 1 or group in _agreeing:
        yield
        return
    _agreeing.append(group)
    error: Exception | None = None
    peer_failed = False
    try:
        yield
    except _PeerFailed:
        peer_failed = True
    except Exception as raised:
        error = raised
    finally:  # also when a KeyboardInterrupt leaves the block: later collectives are no longer in it
        _agreeing.pop()
    # The fixed point: every rank that did not stop at another's flag comes here, with its own verdict.
    if peer_failed or _any_rank_failed(group, failed=error is not None):
        raise_first_error(error, group)


def raise_first_error(error: Exception | None, group: ProcessGroup) -> None:
    """Exchanges every rank's error (None where it has none) and raises the first rank's on every rank, or returns
    when no rank has one (a collective)."""
    described = None if error is None else (type(error), str(error))
    errors: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, described, group=group)
    first = next((found for found in errors if found is not None), None)
    if first is None:
        return
    if error is not None and described == first:
        raise error  # this rank's own: its traceback says where
    raise rebuilt_error(*first)


def rebuilt_error(kind: type, message: str) -> Exception:
    """An exception of type `kind` with `message`, as another rank raised it."""
    try:
        return kind(message)
    except Exception:  # noqa: BLE001 - a type that takes more than its message
        return RuntimeError(f"{kind.__name__}: {message}")


def _any_rank_failed(group: ProcessGroup, failed: bool) -> bool:
    """One all-reduce (max) of this rank's failure flag over `group`."""
    backend = str(dist.get_backend(group))
    device = torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend else torch.device("cpu")
    with real_values():  # read here: a real flag in a simulation too (`tp_train.parallel.fake_ranks`)
        flag = torch.tensor([int(failed)], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())
