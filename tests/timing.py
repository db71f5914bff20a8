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


# With `TP_TRAIN_TEST_CPU=<file>`: each pytest worker moves itself into a cpuacct cgroup of its own (cgroup v1, as
# root; without one, nothing is recorded) before it starts any process, so its rank pools, the forked train.py server
# and every process a test starts are counted with it; one JSON line per test gives its CPU-seconds, which, unlike
# wall seconds, do not depend on what the other workers run meanwhile.
_CPUACCT = "/sys/fs/cgroup/cpuacct"
_cgroup: str | None = None


def join_cpu_cgroup(worker: str) -> None:
    """In a pytest worker, with a CPU file set: moves this process into cgroup `tp_train_test_<worker>`."""
    global _cgroup
    if not os.environ.get("TP_TRAIN_TEST_CPU") or not os.access(_CPUACCT, os.W_OK):
        return
    path = os.path.join(_CPUACCT, f"tp_train_test_{worker}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "tasks"), "w") as tasks:
        tasks.write(str(os.getpid()))
    _cgroup = path


def cpu_seconds() -> float | None:
    """The CPU-seconds this worker's cgroup has used, or None without one."""
    if _cgroup is None:
        return None
    with open(os.path.join(_cgroup, "cpuacct.usage")) as usage:
        return int(usage.read()) / 1e9


def record_cpu(test: str, seconds: float) -> None:
    with open(os.environ["TP_TRAIN_TEST_CPU"], "a") as file:
        file.write(json.dumps({"test": test, "cpu_s": round(seconds, 3)}) + "\n")
