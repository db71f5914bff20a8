"""Runs `train.py` with several sets of overrides for the price of one start-up: this process imports train.py's
modules (torch, Lightning, Hydra) once, then each case runs train.py as `__main__` in a forked child, as
`python train.py <overrides>` would, with its own stdout, stderr and exit status. For runs that end in the
launching process (preflight refusals); a run that starts ranks needs a real `python train.py`.

A case naming a `module` runs that module as `__main__` instead, with `overrides` as its arguments, as its console
script would (`tp_train.app.generate` is `tp-train-generate`); the module is imported once, before any fork. Its own
ranks are forked from the child, as from the console script.

    python -m tests.train_cases < cases.json > results.json
    cases: [{"overrides": [...], "env": {...}, "directory": "...", "module": "..." (optional)}];
    results: [{"status", "stdout", "stderr"}]
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_case(case: dict) -> int:
    """Forks a child that runs train.py (or the case's module) with `case`'s overrides; returns its exit status."""
    directory = Path(case["directory"])
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    status = 1
    try:
        for fd, name in ((1, "stdout"), (2, "stderr")):
            os.dup2(os.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ.update(case.get("env", {}))
        if case.get("module"):
            sys.argv = [case["module"], *case["overrides"]]
            runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["train.py", *case["overrides"]]
            runpy.run_path(str(ROOT / "train.py"), run_name="__main__")  # as `python train.py` runs it
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the process would, before os._exit ends it
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def main() -> None:
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    import train  # noqa: F401 - its imports (torch, Lightning, Hydra) happen once, before forking

    cases = json.load(sys.stdin)
    for module in sorted({case["module"] for case in cases if case.get("module")}):
        importlib.import_module(module)
    results = []
    for case in cases:
        status = _run_case(case)
        directory = Path(case["directory"])
        output = {name: (directory / name).read_text() for name in ("stdout", "stderr")}
        results.append({"status": status, **output})
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
