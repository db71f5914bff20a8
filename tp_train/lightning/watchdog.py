"""Ending the whole job promptly, naming the rank, when one rank of it dies."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time

from tp_train.errors import first_line

LAUNCHER_PID = "TP_TRAIN_LAUNCHER_PID"  # set in each child's environment by the launcher
POLL_SECONDS = 0.5
GRACE_SECONDS = 5.0  # after a failure, how long to wait for the rank that caused it to be seen dead
EXIT_WAIT_SECONDS = 60.0  # how long the launcher, at its exit, waits for its children to end
USER_ERROR_STATUS = 2  # train.py's status for a user error, reported once by rank 0


def describe_exit(returncode: int) -> str:
    """'was killed by SIGKILL' or 'exited with status 1'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


def _error(message: str) -> None:
    # On a line of its own: a progress bar may have left the cursor mid-line.
    print(f"\nerror: {message}", file=sys.stderr, flush=True)


class ChildRanks:
    """The launcher's view of its child ranks: `procs[i]` runs global rank `ranks[i]`."""

    def __init__(self, procs: list[subprocess.Popen], ranks: list[int], own_rank: int) -> None:
        self.procs, self.ranks, self.own_rank = procs, ranks, own_rank
        self._lock = threading.Lock()
        self._stopped = False

    def watch(self) -> None:
        """Starts a daemon thread that ends the job (status 1) once a child exits non-zero, and has the launcher's
        exit wait for the children (`await_children`)."""
        threading.Thread(target=self._watch, name="tp-train-child-ranks", daemon=True).start()
        atexit.register(self.await_children, EXIT_WAIT_SECONDS)

    def await_children(self, timeout: float) -> None:
        """At the launcher's exit, waits up to `timeout` seconds for the children, which are finishing the same
        program: none then sees its launcher gone while it ends, and one that fails as it ends is still reported
        (by the watch thread, with status 1) rather than lost behind the launcher's status 0."""
        deadline = time.monotonic() + timeout
        while not self._stopped and time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
            time.sleep(POLL_SECONDS / 5)

    def failed(self) -> list[str]:
        """'rank 1 (pid 123) was killed by SIGKILL' for each child that exited non-zero."""
        return [
            f"rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)}"
            for proc, rank in zip(self.procs, self.ranks, strict=True)
            if proc.poll() not in (None, 0)
        ]

    def on_own_failure(self, error: BaseException) -> None:
        """The launcher's rank failed: name the rank that died first (a child whose death broke a collective, or
        this one) and kill the children."""
        deadline = time.monotonic() + GRACE_SECONDS
        while not (dead := self.failed()) and time.monotonic() < deadline and _looks_like_a_peer_died(error):
            time.sleep(POLL_SECONDS / 5)
        reason = dead or [f"rank {self.own_rank} (pid {os.getpid()}) failed: {first_line(error)}"]
        self._stop("; ".join(reason))

    def _watch(self) -> None:
        while not self._stopped:
            time.sleep(POLL_SECONDS)
            dead = self.failed()
            if dead and any(proc.returncode == USER_ERROR_STATUS for proc in self.procs):
                time.sleep(GRACE_SECONDS)  # a user error (a checkpoint that does not fit) this rank reports itself
                if self._stopped:
                    return
            if dead:
                if self._stop("; ".join(dead)):
                    os._exit(1)  # the launcher may be blocked in a collective with the dead rank
                return
            if all(proc.returncode == 0 for proc in self.procs):
                return

    def stop(self) -> None:
        """Kills the children (SIGKILL, which ends a stopped one too) without reporting them: the caller reported
        why (the hang detector, or the launcher's rank on a user error every rank hits alike)."""
        self._stop(None)

    def _stop(self, reason: str | None) -> bool:
        """Reports `reason` (if any) and kills the remaining children, once; True if this call did it."""
        with self._lock:
            if self._stopped:
                return False
            self._stopped = True
        alive = {rank: proc for proc, rank in zip(self.procs, self.ranks, strict=True) if proc.poll() is None}
        if reason is not None:
            _error(f"{reason}; stopping the job" + (f" (killing ranks {list(alive)})" if alive else ""))
        for proc in alive.values():
            proc.kill()  # SIGKILL: a rank blocked in a collective does not act on SIGTERM
        return True


def _looks_like_a_peer_died(error: BaseException) -> bool:
    """A failed collective (gloo reports a closed connection, NCCL a timeout or abort) rather than this rank's own
    error: worth waiting briefly to see which rank died."""
    return isinstance(error, RuntimeError) or "DistBackendError" in type(error).__name__


def watch_launcher(own_rank: int) -> None:
    """In a child rank: a daemon thread that ends this process (status 1) once the launcher is gone, until this
    process itself begins to exit (the launcher may then be gone first, normally)."""
    if _watching_launcher.is_set():
        return  # one watcher per process (fit, then validate, launch twice)
    _watching_launcher.set()
    launcher = int(os.environ[LAUNCHER_PID])
    exiting = threading.Event()
    atexit.register(exiting.set)

    def watch() -> None:
        while not exiting.wait(POLL_SECONDS):
            if os.getppid() != launcher:
                launcher_gone(own_rank)
                os._exit(1)

    threading.Thread(target=watch, name="tp-train-launcher-watch", daemon=True).start()


_watching_launcher = threading.Event()
_reported = threading.Event()


def launcher_gone(own_rank: int, wait: float = 0.0) -> bool:
    """True (and says so on stderr, once) if the launcher is gone, waiting up to `wait` seconds to find out."""
    launcher = int(os.environ[LAUNCHER_PID])
    deadline = time.monotonic() + wait
    while os.getppid() == launcher:
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_SECONDS / 5)
    if not _reported.is_set():
        _reported.set()
        _error(f"rank {own_rank} (pid {os.getpid()}): rank 0, the launching process (pid {launcher}), died; stopping")
    return True


def on_child_failure(own_rank: int, error: BaseException) -> None:
    """A child rank failed: if the launcher's death caused it, say so (the launcher can no longer), else name this
    rank and its error (before the launcher sees its collectives fail)."""
    wait = 1.0 if _looks_like_a_peer_died(error) else 0.0  # an orphan is re-parented within milliseconds
    if LAUNCHER_PID not in os.environ or not launcher_gone(own_rank, wait=wait):
        _error(f"rank {own_rank} (pid {os.getpid()}) failed: {first_line(error)}")
