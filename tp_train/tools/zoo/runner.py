"""Running the zoo: each family's ranks in their own processes, forked from a server that imported torch and
transformers once, `jobs` families at a time, each with a time limit; and the summary table."""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import signal
import socket
import tempfile
import time
from datetime import timedelta

from tp_train.tools.zoo.check import CLASSES, NOT_COUNTED, check_family


def _rank_main(model_type: str, case: dict, rank: int, world_size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            check = case.get("check", check_family)
            result = check(model_type, task=case["task"], fields=case["fields"])
    except BaseException as error:  # noqa: BLE001 - reported as the family's error
        result = {"class": "error", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.send(result)


def _rank_with_stacks(target, stacks: str, *args) -> None:
    """Runs a rank's `target(*args)`, its threads' stacks written to the file `stacks` when the zoo sends SIGUSR1
    (before it kills a family that ran past its time limit: where each rank waited)."""
    import faulthandler

    with open(stacks, "w") as file:
        faulthandler.register(signal.SIGUSR1, file=file, all_threads=True)
        target(*args)


def _innermost(stacks: str, frames: int = 4) -> str:
    """The innermost `frames` calls of the thread that took the signal (faulthandler's "Current thread"), as
    "function (file:line)", innermost first; "no stack" when the rank wrote none."""
    current = stacks.split("Current thread")[-1] if "Current thread" in stacks else stacks
    calls = []
    for line in current.splitlines():
        line = line.strip()
        if line.startswith("File "):  # File "/path/x.py", line 12 in func
            path, _, rest = line[len('File "') :].partition('", line ')
            number, _, function = rest.partition(" in ")
            calls.append(f"{function} ({os.path.basename(path)}:{number})")
    return " < ".join(calls[:frames]) or "no stack"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Family:
    """One family's ranks, each a process forked from a server that imported torch and transformers once."""

    def __init__(self, context, model_type: str, case: dict, tp: int, timeout: float, target=None):
        self.model_type, self.timeout, port = model_type, timeout, _free_port()
        self.deadline = time.monotonic() + timeout
        self.receiver, sender = context.Pipe(duplex=False)
        self.stacks = tempfile.mkdtemp(prefix=f"zoo-{model_type}-")
        self.ranks = [
            context.Process(
                target=_rank_with_stacks,
                args=(target or _rank_main, self._stack_file(rank), model_type, case, rank, tp, port, sender),
                daemon=True,
            )
            for rank in range(tp)
        ]
        for rank in self.ranks:
            rank.start()
        sender.close()

    def result(self) -> dict | None:
        """The family's result once rank 0 sends it (or its ranks die, or the deadline passes), else None. A rank
        killed by a signal the zoo did not send makes it `killed`, whatever rank 0 sent (its collectives failed)."""
        if self.receiver.poll():
            try:
                result = self.receiver.recv()
            except EOFError:
                result = None
            if result is not None:
                return self._killed(self._stop(timeout=10)) or result
        if all(not rank.is_alive() for rank in self.ranks):
            codes = self._stop(timeout=0)
            return self._killed(codes) or {"class": "error", "reason": f"ranks exited with codes {codes} and no result"}
        if time.monotonic() > self.deadline:
            return self._hung()
        return None

    def _stack_file(self, rank: int) -> str:
        return os.path.join(self.stacks, f"rank{rank}.txt")

    def _hung(self) -> dict:
        """`killed` for ranks still running at the deadline (a deadlock is a hang, not slowness), with where each
        rank was: its stacks, written when the zoo signals it, innermost calls in the reason and whole in `stacks`."""
        alive = [rank for rank, process in enumerate(self.ranks) if process.is_alive()]
        for rank in alive:
            os.kill(self.ranks[rank].pid, signal.SIGUSR1)
        time.sleep(1.0)  # faulthandler writes from its signal handler, at once even in a collective's wait
        stacks = {}
        for rank in alive:  # no file: the rank had not started its work (still importing)
            path = self._stack_file(rank)
            stacks[rank] = open(path).read() if os.path.exists(path) else ""
        self._stop(timeout=0)
        where = "; ".join(f"rank {rank} in {_innermost(text)}" for rank, text in stacks.items())
        reason = f"killed: no result within {self.timeout:.0f}s, ranks {alive} still running (a hang?): {where}"
        return {"class": "killed", "reason": reason, "stacks": stacks}

    @staticmethod
    def _killed(codes: list) -> dict | None:
        """`killed` when a rank's exit code (None: still running when the zoo stopped it) is a signal's."""
        killed = {rank: -code for rank, code in enumerate(codes) if code is not None and code < 0}
        if not killed:
            return None
        ranks = ", ".join(f"rank {rank} by {signal.Signals(number).name}" for rank, number in killed.items())
        return {"class": "killed", "reason": f"killed: {ranks} (out of memory, if SIGKILL)"}

    def _stop(self, timeout: float) -> list:
        """Each rank's exit code before the zoo stopped it (None for one it had to kill)."""
        codes = []
        for rank in self.ranks:
            rank.join(timeout)
            codes.append(rank.exitcode)
            if rank.is_alive():
                rank.kill()
                rank.join()
        shutil.rmtree(self.stacks, ignore_errors=True)
        return codes


def run_zoo(
    model_types: list[str],
    tp: int = 2,
    jobs: int = 2,
    timeout: float = 180,
    echo=None,
    task: str = "causal-lm",
    fields: dict | None = None,
    target=None,
    check=check_family,
) -> dict[str, dict]:
    """{family: result} for each family of `task`, `jobs` families at a time, then each one `killed` again alone;
    `fields` set in every family's tiny config (a setting of the run: its kv heads). `check(model_type, task=,
    fields=)` is what each rank runs (parity, `check_family`; the init column, `init_check.check_init`; a module-level
    function: the ranks import it by name); `target` runs a rank (tests)."""
    import multiprocessing

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks' warnings would bury the table
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "tp_train", "models.hf", "tp_train.tools.zoo_tasks"])
    echo = echo or (lambda line: print(line, flush=True))
    case = dict(task=task, fields=fields, check=check)
    results = _run_families(model_types, jobs, lambda name: _Family(context, name, case, tp, timeout, target), echo)
    killed = [name for name in model_types if results[name]["class"] == "killed"]
    if killed and jobs > 1:
        echo(f"again, one at a time: {', '.join(killed)}")
        results |= _run_families(killed, 1, lambda name: _Family(context, name, case, tp, timeout, target), echo)
    return results


def _run_families(model_types: list[str], jobs: int, start, echo) -> dict[str, dict]:
    """{family: result}, `jobs` families at a time, each started by `start(family)` (a `_Family`)."""
    pending, running, results = list(model_types), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            running.append(start(pending.pop(0)))
        for family in list(running):
            result = family.result()
            if result is not None:
                running.remove(family)
                results[family.model_type] = result
                echo(f"{family.model_type:<28} {result['class']:<11} {result['reason']}")
        time.sleep(0.2)
    return results


def summary(results: dict[str, dict], tp: int) -> str:
    """The README's table: counts per class, then every family not passing, with its reason."""
    counts = {name: sum(r["class"] == name for r in results.values()) for name in CLASSES}
    buildable = len(results) - sum(counts[name] for name in NOT_COUNTED)
    partial = sorted(name for name, r in results.items() if r["class"] == "pass" and r.get("kept_whole"))
    share = counts["pass"] / max(buildable, 1)
    lines = [
        f"{counts['pass']} of {buildable} buildable families pass at tp={tp} ({share:.0%}); "
        f"round-off {counts['round-off']}, refused {counts['refused']}, WRONG {counts['WRONG']}, "
        f"killed {counts['killed']}, error {counts['error']}, unsharded {counts['unsharded']}; "
        f"{counts['unbuildable']} not buildable from a tiny config"
        + (f", {counts['no blocks']} with no Linear in their blocks" if counts["no blocks"] else ""),
    ]
    if partial:
        lines.append(f"pass with attention kept whole ({len(partial)}): {', '.join(partial)}")
    for name in ("WRONG", "round-off", "unsharded", "refused", "killed", "error", "unbuildable", "no blocks"):
        for family, result in sorted(results.items()):
            if result["class"] == name:
                lines.append(f"{name:<8} {family:<26} {result['reason']}")
    return "\n".join(lines)
