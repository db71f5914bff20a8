"""Where the suite's seconds go: with `TP_TRAIN_TEST_TIMING=<file>`, the harnesses append one JSON line per rank call
(`tests.distributed.run_on_ranks`: start-up, function, teardown) and per forked `train.py` run
(`tests.train_cases.run`), each named by the running test. docs/install.md's table of test times is made from it."""

from __future__ import annotations

import json
import os
import time


def current_test() -> str:
    """The running test's id, as pytest names it ("tests/test_x.py::test_y[param]")."""
    return os.environ.get("PYTEST_CURRENT_TEST", "(no test)").rsplit(" ", 1)[0]


def record(kind: str, **seconds: float) -> None:
    """Appends `{"test", "kind", **seconds}` to the timing file, if one is set."""
    path = os.environ.get("TP_TRAIN_TEST_TIMING")
    if path:
        with open(path, "a") as file:
            file.write(json.dumps({"test": current_test(), "kind": kind, **seconds}) + "\n")


# Phases of `tp_train.parallelize` timed inside rank functions (the rest of a function is building its models and
# running their steps): the plan's resolution (a family record, or the auto-planner) and its verification.
PHASES = {"planning": "resolve_plan", "verification": "verify_parallelized"}
_spent: dict[str, float] = {}


def time_phases() -> None:
    """In a rank process, with a timing file set: wraps each of PHASES where `parallelize` calls it, adding up its
    seconds for `phases_spent`."""
    if not os.environ.get("TP_TRAIN_TEST_TIMING"):
        return
    import tp_train.plan.parallelize as parallelize

    for phase, name in PHASES.items():
        real = getattr(parallelize, name)

        def timed(*args, _real=real, _phase=phase, **kwargs):
            started = time.monotonic()
            try:
                return _real(*args, **kwargs)
            finally:
                _spent[_phase] = _spent.get(_phase, 0.0) + time.monotonic() - started

        setattr(parallelize, name, timed)


def phases_spent() -> dict[str, float]:
    """The seconds of each phase since the last call (see time_phases)."""
    spent = dict(_spent)
    _spent.clear()
    return spent
