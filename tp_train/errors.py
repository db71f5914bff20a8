"""Every error type tp_train raises, and the one-line helper: a user's mistake is reported in one line naming the
key or module, the value and what would work."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the training config (exit status 2)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message is one line naming the file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holding more than data (a pickle naming code to run), refused before it is unpickled."""


class PlanVerificationError(ValueError):
    """The sharded model computes something other than the unsharded model: the plan is wrong."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped the run (raised on every rank at the same step)."""


def first_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for an error whose message may span many lines."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
