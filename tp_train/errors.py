"""Error reporting shared by the checks that stop a run: errors are reported in one line."""

from __future__ import annotations


def first_line(error: BaseException) -> str:
    """'TypeName: first line of the message', for an error whose message may span many lines."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"
