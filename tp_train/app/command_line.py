"""`train.py`'s arguments as typed, before Hydra reads them: a checkpoint path pasted as a run printed it.

Hydra's override grammar takes no `=` in an unquoted value, and checkpoints that Lightning names by default (and
tp_train named before `step000020.ckpt`) are `epoch=0-step=20.ckpt`: `ckpt_path=<run>/checkpoints/epoch=0-step=20.ckpt`,
pasted from a `resuming from ...` line, stopped in Hydra's parser with `mismatched input '=' expecting <EOF>`, a
line that says nothing about quoting. Hydra parses before any code of the app runs, so `train.py` quotes such a
value in `sys.argv` first, as the user would have had to.
"""

from __future__ import annotations

import re

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException

# Keys whose value is a file or directory: there an `=` is part of a name, never Hydra syntax.
PATH_KEYS = ("ckpt_path", "model.path")
MULTIRUN_FLAGS = ("-m", "--multirun")


def quote_paths(argv: list[str]) -> None:
    """Quotes, in place, each `ckpt_path=...` or `model.path=...` override of `argv` (a command line, program first)
    whose value holds `=` and which Hydra's grammar refuses as written: `ckpt_path=a/epoch=0-step=20.ckpt` becomes
    `ckpt_path='a/epoch=0-step=20.ckpt'`, which Hydra reads as that path. What Hydra parses as written (a path
    quoted already, an interpolation) is left as it is, and so is a value with a comma under `-m`, where the user
    may mean a sweep over several paths."""
    multirun = any(argument in MULTIRUN_FLAGS for argument in argv[1:])
    for index, argument in enumerate(argv[1:], start=1):
        key, _, value = argument.partition("=")
        if key.lstrip("+") not in PATH_KEYS or "=" not in value or (multirun and "," in value):
            continue
        quoted = f"{key}={hydra_quoted(value)}"
        if not _parses(argument) and _parses(quoted):
            argv[index] = quoted


def hydra_quoted(value: str) -> str:
    """`value` in single quotes as Hydra's grammar reads it back: each quote escaped, and the backslashes doubled
    that come before a quote or before the closing one (Hydra's escaping rule for quoted values)."""
    escaped = re.sub(r"(\\*)('|\Z)", lambda match: match[1] * 2 + ("\\'" if match[2] else ""), value)
    return f"'{escaped}'"


def _parses(override: str) -> bool:
    try:
        OverridesParser.create().parse_override(override)
    except HydraException:
        return False
    return True
