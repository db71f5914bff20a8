"""Runs `train.py` for the price of one start-up: this process imports train.py's modules (torch, Lightning, Hydra,
transformers: about 5 CPU-seconds of each `python train.py`) once, then each case runs train.py as `__main__` in a
forked child, as `python train.py <overrides>` would, with its own stdout, stderr and exit status. Its child ranks
are forks too: Lightning's launcher asks for them with its usual `subprocess.Popen` call, and each is a copy of the
case taken before train.py ran (`_child_ranks_by_fork`).

A case naming a `module` runs that module as `__main__` instead, with `overrides` as its arguments, as its console
script would (`tp_train.app.generate` is `tp-train-generate`); the module is imported once, before any fork. Its own
ranks are forked from the child, as from the console script.

Three ways in:
- `run(command, cwd=..., env=..., timeout=...)`, for tests: `subprocess.run(command, capture_output=True,
  text=True, ...)` for a `python train.py ...` command (or tests/signal_at_step.py's, which runs train.py), served
  by this pytest worker's own server (started at its first call, `python -m tests.train_cases --serve`: a case per
  line on stdin; it answers with the child's pid, then its exit status). Tests that signal the job from outside or
  time it by its pipes (every rank's end) start it themselves.
- `run_batch(cases, timeout)` and `run_module(module, arguments, timeout)`, for tests: a batch's cases (below), or
  one `python -m module`, served by this pytest worker's server.
- A batch: `python -m tests.train_cases < cases.json > results.json`,
  cases: [{"overrides": [...], "env": {...}, "directory": "...", "module": "..." (optional)}];
  results: [{"status", "stdout", "stderr"}]
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from functools import partial
from pathlib import Path

from tests import timing

ROOT = Path(__file__).resolve().parents[1]


def _run_case(case: dict) -> int:
    """Forks a child that runs train.py (or the case's module) with `case`'s overrides; returns its exit status."""
    return os.waitstatus_to_exitcode(os.waitpid(_start_case(case), 0)[1])


def _start_case(case: dict) -> int:
    """Forks the child that runs `case`; returns its pid."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    _run_as_main(partial(_case_main, case))


def _case_main(case: dict) -> None:
    """The forked child's program: `case`'s output files, directory and environment, then train.py (or its
    module, or its script) as `__main__`."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(Path(case["directory"]) / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if "cwd" in case:
        os.chdir(case["cwd"])
    if case.get("whole_env"):  # as subprocess.run(env=...): the case's environment and nothing else
        os.environ.clear()
    os.environ.update(case.get("env", {}))
    _child_ranks_by_fork(case.get("child_ranks", _FORKED_RANKS))
    if case.get("module"):
        sys.argv = [case["module"], *case["overrides"]]
        runpy.run_module(case["module"], run_name="__main__", alter_sys=True)
    else:
        script = case.get("script", "train.py")
        sys.argv = [script, *case["overrides"]]
        runpy.run_path(str(ROOT / script), run_name="__main__")  # as `python train.py` runs it


def _run_as_main(main) -> None:
    """Runs `main()` as this process's program and ends the process with its status, as the interpreter would: 0,
    a SystemExit's code, or 1 after printing the traceback of any other exception."""
    status = 1
    try:
        main()
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported as the process would, before os._exit ends it
        traceback.print_exc()
    finally:
        _exit_as_the_interpreter_would(status)


# Child ranks a case may start as forks of itself: the most any test's run starts beside rank 0 (tp=4, tp=2 x cp=2).
_FORKED_RANKS = 3


def _child_ranks_by_fork(ranks: int) -> None:
    """Has Lightning's launcher start this case's child ranks (`python train.py ...` with the rank's environment and
    directory) as forks of this process taken now, before train.py runs, so that a rank skips the imports (~4
    CPU-seconds) and starts as the command would. Each is this process's own child, as a launched rank is (the
    product's watchdog checks its parent); an idle one ends with this process. Any other command, or a rank past
    the `ranks` forked, is started as usual."""
    from lightning.pytorch.strategies.launchers import subprocess_script

    idle = []
    for _ in range(ranks):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(write)
            for _, earlier in idle:
                os.close(earlier)  # so that each idle fork sees its own pipe end when this process ends
            _run_rank(read)
        os.close(read)
        idle.append((pid, write))

    class _Launching:
        """`subprocess` as subprocess_script sees it."""

        @staticmethod
        def Popen(command, env=None, cwd=None, **kwargs):  # noqa: N802 - subprocess.Popen's name
            if kwargs or not idle or command[0] != sys.executable or not command[1].endswith("train.py"):
                return subprocess.Popen(command, env=env, cwd=cwd, **kwargs)
            pid, write = idle.pop(0)
            rank = {"argv": command[1:], "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd()}
            with os.fdopen(write, "wb") as pipe:
                pipe.write(json.dumps(rank).encode())
            return _ForkedRank(pid, command)

    subprocess_script.subprocess = _Launching


def _run_rank(read: int) -> None:
    """An idle fork: waits for its rank's command, environment and directory, then runs it as `python train.py`
    would; ends at once if its case ended first."""
    with os.fdopen(read, "rb") as pipe:
        request = pipe.read()
    if not request:
        os._exit(0)
    rank = json.loads(request)

    def main() -> None:
        os.chdir(rank["cwd"])
        os.environ.clear()
        os.environ.update(rank["env"])
        sys.argv = rank["argv"]
        runpy.run_path(sys.argv[0], run_name="__main__")

    _run_as_main(main)


class _ForkedRank:
    """What the launcher and the product's watchdog use of a `subprocess.Popen`, for a forked rank."""

    def __init__(self, pid: int, args: list[str]):
        self.pid, self.args, self.returncode = pid, args, None

    def poll(self) -> int | None:
        return self._wait(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.01)
        return self.returncode

    def _wait(self, flags: int) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, flags)
            except ChildProcessError:  # reaped elsewhere: as subprocess.Popen, taken as 0
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _exit_as_the_interpreter_would(status: int) -> None:
    """Ends the child as `python train.py` ends: non-daemon threads joined, then the exit handlers registered since
    the fork (last first: W&B's, the launcher's wait for its ranks, then train.py's own, which ends the process with
    the run's status), then os._exit for a run that left none to end it."""
    try:
        threading._shutdown()  # what the interpreter does before its exit handlers
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def serve() -> None:
    """One case per line on stdin, one at a time: answers {"pid"} once the child runs, then {"status"} when it ended."""
    for line in sys.stdin:
        case = json.loads(line)
        if case.get("module"):
            importlib.import_module(case["module"])  # once, before the fork, for this case and the next ones
        pid = _start_case(case)
        print(json.dumps({"pid": pid}), flush=True)
        print(json.dumps({"status": os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)


_SERVER: list[subprocess.Popen] = []  # this process's server, started at the first run()


def _server() -> subprocess.Popen:
    if _SERVER and _SERVER[0].poll() is None:
        return _SERVER[0]
    # Unbuffered bytes: a buffered reader could read both answers at once, and select() would then wait on the pipe
    # for the second one, already read.
    server = subprocess.Popen([sys.executable, "-m", "tests.train_cases", "--serve"], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)  # fmt: skip
    atexit.register(server.stdin.close)  # the server ends at the end of its input
    _SERVER[:] = [server]
    return server


def _answer(server: subprocess.Popen, deadline: float) -> dict | None:
    """The server's next answer, or None at `deadline`."""
    while not select.select([server.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
        if time.monotonic() >= deadline:
            return None
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"tests.train_cases server ended (status {server.wait()})")
    return json.loads(line)


def run_batch(cases: list[dict], timeout: float) -> list[dict]:
    """The batch's results (see the module's docstring) for `cases`, run one after the other by this pytest worker's
    server, whose start-up they share with its other runs; each case's `directory` receives its stdout and stderr."""
    results = []
    for case in cases:
        status, output = _served(case, timeout)
        if status is None:
            command = f"tests.train_cases.run_batch: {case.get('overrides')}"
            raise subprocess.TimeoutExpired(command, timeout, output=output["stdout"], stderr=output["stderr"])
        results.append({"status": status, **output})
    return results


def _served(case: dict, timeout: float) -> tuple[int | None, dict[str, str]]:
    """Runs `case` on this worker's server: its exit status (None: killed at `timeout`, counted from its fork, since a
    server's first answer waits for the server's own imports) and the stdout and stderr it left in its directory."""
    server = _server()
    server.stdin.write((json.dumps(case) + "\n").encode())
    pid = _answer(server, time.monotonic() + timeout + 60)["pid"]
    answer = _answer(server, time.monotonic() + timeout)
    if answer is None:
        os.kill(pid, signal.SIGKILL)
        _answer(server, time.monotonic() + 60)
    output = {name: (Path(case["directory"]) / name).read_text(errors="replace") for name in ("stdout", "stderr")}
    return (None if answer is None else answer["status"]), output


def run_module(module: str, arguments: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, "-m", module, *arguments], capture_output=True, text=True, timeout=timeout)`
    from the project's root, run as a batch's case by this pytest worker's server (`run_batch`), in the environment
    the server started with."""
    directory = Path(tempfile.mkdtemp(prefix="module-case-"))
    try:
        case = {"module": module, "overrides": arguments, "directory": str(directory), "child_ranks": 0}
        (result,) = run_batch([case], timeout)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    command = [sys.executable, "-m", module, *arguments]
    return subprocess.CompletedProcess(command, result["status"], result["stdout"], result["stderr"])


# What run() runs: train.py, or the script that runs it and signals itself at a step.
SCRIPTS = ("train.py", "tests/signal_at_step.py")


def run(
    command: list[str], *, cwd: Path, env: dict | None = None, timeout: float, child_ranks: int = _FORKED_RANKS
) -> subprocess.CompletedProcess:
    """`subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for `command` =
    `[sys.executable, script, *overrides]` (a script of SCRIPTS) run from the project's root, forked from this
    process's server; `child_ranks`: the ranks beside rank 0 that the run's launcher starts as forks (more start
    as fresh interpreters)."""
    if command[0] != sys.executable or command[1] not in SCRIPTS or Path(cwd).resolve() != ROOT:
        raise ValueError(f"tests.train_cases.run: {command[:2]} in {cwd}; it runs `python` {SCRIPTS} from {ROOT}")
    directory = Path(tempfile.mkdtemp(prefix="train-case-"))
    called = time.monotonic()
    try:
        environment = dict(os.environ) if env is None else env
        case = {"script": command[1], "overrides": command[2:], "env": environment, "whole_env": True, "cwd": str(cwd),
                "directory": str(directory), "child_ranks": child_ranks}  # fmt: skip
        status, output = _served(case, timeout)
        if status is None:
            raise subprocess.TimeoutExpired(command, timeout, output=output["stdout"], stderr=output["stderr"])
        return subprocess.CompletedProcess(command, status, output["stdout"], output["stderr"])
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        timing.record("train.py forked", s=time.monotonic() - called)


# What a run imports after train.py's own imports (a module list, not a run: nothing here may change a result).
LATE_IMPORTS = (
    "transformers.models.llama.modeling_llama",
    "tp_train.app.data",
    "tp_train.app.schedulers",
    "tp_train.tools.optimizer",
    "tp_train.lightning.hang",
    "tp_train.lightning.rng_state",
    "torch.distributed.checkpoint._fsspec_filesystem",
)


def _warm_first_uses() -> None:
    """Pays once, before any fork, what every run would pay at its first use of a library and that changes none of
    its results (about half a CPU-second of each case and of each of its ranks, measured 2026-12-06): Hydra's first
    composition (its override grammar's parser tables, its plugins found, conf/ read), and transformers' index of
    its model packages and the modelling code every family's module imports (one family's module, Llama's, brings
    it), at the first model built. The composition's Hydra is cleared after it, as a fresh process has none.
    Also the modules train.py imports only when the config is built: the data module's (`datasets`, which brings
    pandas and pyarrow, ~1 CPU-second in every rank, since the config's token-id resolver imports it) and the
    optimizer's, scheduler's and strategy's helpers."""
    from hydra import compose, initialize_config_dir

    for module in LATE_IMPORTS:
        importlib.import_module(module)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        compose("train", return_hydra_config=True)


def main() -> None:
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    import train  # noqa: F401 - its imports (torch, Lightning, Hydra) happen once, before forking

    _warm_first_uses()
    gc.freeze()  # what is imported stays out of every forked case's collections, which would walk (and copy) it
    if sys.argv[1:] == ["--serve"]:
        serve()
        return

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
