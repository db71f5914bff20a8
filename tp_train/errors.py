"""Every error type tp_train raises, and the one-line helper: a user's mistake is reported in one line naming the
key or module, the value and what would work."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user error in the training config (exit status 2)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this model; the message is one line naming the file and why."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint file holding more than data (a pickle naming code to run), refused before it is unpickled."""


class DiskFullError(OSError):
    """A checkpoint save refused (before it started) or stopped for lack of disk space: one line naming the
    directory, the bytes needed and free, and the checkpoint that stays valid; no complete checkpoint was touched."""


class PlanVerificationError(ValueError):
    """The sharded model computes something other than the unsharded model: the plan is wrong."""


class HeadOutputChangedError(RuntimeError):
    """The model transformed its LM head's output before the loss (a logit soft-cap or scale), so the head and the
    loss cannot run fused: the head's logits must exist."""


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient stopped the run (raised on every rank at the same step)."""


def first_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for an error whose message may span many lines."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
