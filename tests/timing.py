"""Where the suite's seconds go: with `TP_TRAIN_TEST_TIMING=<file>`, the harnesses append one JSON line per rank call
(`tests.distributed.run_on_ranks`: start-up, function, teardown) and per forked `train.py` run
(`tests.train_cases.run`), each named by the running test. docs/install.md's table of test times is made from it."""

from __future__ import annotations

import json
import os


def current_test() -> str:
    """The running test's id, as pytest names it ("tests/test_x.py::test_y[param]")."""
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" ", 1)[0]


def record(kind: str, **seconds: float) -> None:
    """Appends `{"test", "kind", **seconds}` to the timing file, if one is set."""
    path = os.environ.get("TP_TRAIN_TEST_TIMING")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps({"test": current_test(), "kind": kind, **seconds}) + "\n")
