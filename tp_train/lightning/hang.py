"""Ending the job when a rank hangs: no progress for a bounded time names the rank, writes every reachable rank's
Python stacks and last collectives to the run directory, and exits non-zero.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

from tp_train.lightning import watchdog

DEFAULT_TRAIN_TIMEOUT_S = 60.0
DEFAULT_SETUP_TIMEOUT_S = 600.0
FLIGHT_RECORDER = "TORCH_FR_BUFFER_SIZE"  # collectives torch's flight recorder keeps per process group
VERDICT, RECORD, DUMPED = "hang/verdict", "hang/rank/{}", "hang/dumped/{}"
DUMP_WAIT_S = 10.0  # how long the reporting rank waits for the others' stacks
SETUP, TRAIN, BETWEEN, DONE = "setup", "train", "between steps", "done"


@dataclass
class _Seen:
    """One rank as this process's monitor last saw it, timed on this process's clock."""

    record: dict = field(default_factory=dict)
    beat_at: float = field(default_factory=time.monotonic)
    progress_at: float = field(default_factory=time.monotonic)


class HangDetector(L.Callback):
    """Ends the job when no rank makes progress for a bounded time (see the module docstring).

    Args:
        train_timeout_s: how long a training step may make no progress once the first step has ended.
        setup_timeout_s: the limit before the first step has ended, and between steps (data, validation, saves).
        heartbeat_s: how often each rank publishes its record and looks at the others'.
        directory: where `hang/` goes; default the trainer's `default_root_dir` (the run directory).
        recorded_collectives: entries of torch's flight recorder (`TORCH_FR_BUFFER_SIZE`), unless already set.
    """

    def __init__(
        self,
        train_timeout_s: float = DEFAULT_TRAIN_TIMEOUT_S,
        setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S,
        heartbeat_s: float = 2.0,
        directory: str | None = None,
        recorded_collectives: int = 64,
    ) -> None:
        if not 0 < heartbeat_s < train_timeout_s <= setup_timeout_s:
            raise ValueError(
                f"HangDetector(heartbeat_s={heartbeat_s}, train_timeout_s={train_timeout_s}, setup_timeout_s="
                f"{setup_timeout_s}): need 0 < heartbeat_s < train_timeout_s <= setup_timeout_s"
            )
        self.train_timeout_s, self.setup_timeout_s, self.heartbeat_s = train_timeout_s, setup_timeout_s, heartbeat_s
        self.directory = directory
        os.environ.setdefault(FLIGHT_RECORDER, str(recorded_collectives))  # before any process group exists
        self._progress, self._phase, self._step, self._first_step_done = 0, SETUP, 0, False
        self._thread: threading.Thread | None = None

    def _advance(self, phase: str | None = None, trainer: L.Trainer | None = None) -> None:
        self._progress += 1
        if phase is not None:
            self._phase = phase
        if trainer is not None:
            self._step = trainer.global_step

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._advance(SETUP if not self._first_step_done else BETWEEN)
        if self._thread is None and trainer.world_size > 1 and hasattr(trainer.strategy, "launch"):
            directory = Path(self.directory or trainer.default_root_dir) / "hang"
            store = trainer.strategy.launch.connect(timedelta(seconds=max(self.heartbeat_s * 2, 5.0)))
            children = getattr(trainer.strategy.launcher, "children", None)  # under the popen launcher, on rank 0
            monitor = _Monitor(self, store, trainer.global_rank, trainer.world_size, directory, children)
            self._thread = threading.Thread(target=monitor.run, name="tp-train-hang-detector", daemon=True)
            self._thread.start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._advance(TRAIN, trainer)

    def _progressed(self, *hook_arguments, **hook_keywords) -> None:
        self._advance()

    on_before_backward = on_after_backward = on_before_optimizer_step = _progressed

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._first_step_done = True
        self._advance(BETWEEN, trainer)  # what follows (data, validation, a save) has the longer limit

    def _between_steps(self, *hook_arguments, **hook_keywords) -> None:
        self._advance(BETWEEN)

    on_validation_batch_start = on_validation_batch_end = on_save_checkpoint = _between_steps

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._advance(DONE)

    def record(self) -> dict:
        return {"progress": self._progress, "phase": self._phase, "step": self._step, "trained": self._first_step_done}

    def limit(self, record: dict, frozen: bool, trained: bool, peer_stopped: bool = False) -> float | None:
        """Seconds `record`'s rank may go without progress (None: no limit, it has finished); `frozen`: its own
        heartbeat stopped; `trained`: some rank has ended a training step (so every rank is past set-up);
        `peer_stopped`: some rank's heartbeat stopped once training ran, so a rank waiting between steps (in a save's
        barrier, validation's first collective) waits for a rank that cannot arrive."""
        if record.get("phase") == DONE:
            return None
        if trained and (record.get("phase") == TRAIN or frozen or peer_stopped):
            return self.train_timeout_s
        return self.setup_timeout_s


class _Monitor:
    """The detector's thread on one rank: beats, watches every rank, and ends the job on a hang."""

    def __init__(
        self, detector: HangDetector, store, rank: int, world_size: int, directory: Path, children=None
    ) -> None:
        self.detector, self.store, self.rank, self.world_size = detector, store, rank, world_size
        self.directory, self.children = directory, children  # children: watchdog.ChildRanks of the popen launcher
        self.seen = [_Seen() for _ in range(world_size)]
        self.beat = 0
        self.store_ok_at = time.monotonic()
        # No heartbeat for this long: the process is not running (a few missed beats, well inside the limit).
        self._frozen_after = max(3 * detector.heartbeat_s, min(10.0, detector.train_timeout_s / 2))

    def run(self) -> None:
        while True:  # the first beat at once: a rank's record is in the store from its set-up on
            try:
                self._beat()
                if self.store.check([VERDICT]):
                    return self._end(json.loads(self.store.get(VERDICT)))
                verdict = self._look()
                if verdict is not None:
                    self.store.compare_set(VERDICT, "", json.dumps(verdict))  # the first verdict stands
                    return self._end(json.loads(self.store.get(VERDICT)))
                self.store_ok_at = time.monotonic()
            except Exception:  # noqa: BLE001 - the store's host (rank 0 under popen) stopped, or is gone
                if time.monotonic() - self.store_ok_at > self.detector.train_timeout_s and self.rank != 0:
                    return self._end(
                        {"message": f"the launch's store (on rank 0) stopped answering for "
                                    f"{self.detector.train_timeout_s:.0f} s", "frozen": [0], "by": self.rank},
                        reachable=False,
                    )  # fmt: skip
            time.sleep(self.detector.heartbeat_s)

    def _beat(self) -> None:
        self.beat += 1
        own = {**self.detector.record(), "beat": self.beat, "pid": os.getpid(), "host": socket.gethostname()}
        self.store.set(RECORD.format(self.rank), json.dumps(own))

    def _look(self, now: float | None = None) -> dict | None:
        """The verdict if every rank is stuck past its limit at `now` (this process's monotonic clock), else None."""
        now, frozen = time.monotonic() if now is None else now, []
        for rank, seen in enumerate(self.seen):  # every record first: each rank's clock runs from its own change
            key = RECORD.format(rank)
            record = json.loads(self.store.get(key)) if self.store.check([key]) else {}
            if record.get("beat") != seen.record.get("beat"):
                seen.beat_at = now
            if (record.get("progress"), record.get("phase")) != (seen.record.get("progress"), seen.record.get("phase")):
                seen.progress_at = now
            seen.record = record
        frozen = [rank for rank, seen in enumerate(self.seen) if now - seen.beat_at > self._frozen_after]
        trained = any(seen.record.get("trained") for seen in self.seen)  # every rank is past set-up
        for rank, seen in enumerate(self.seen):
            limit = self.detector.limit(seen.record, rank in frozen, trained, trained and bool(frozen))
            if limit is None or now - seen.progress_at <= limit:
                return None  # this rank is making progress (or has finished): no hang
        return self._verdict(frozen, now)

    def _verdict(self, frozen: list[int], now: float) -> dict:
        records = [seen.record for seen in self.seen]
        if frozen:
            named = frozen
            why = "stopped responding (its process is not running: stopped, or the host froze)"
        else:
            lowest = min(record.get("step", 0) for record in records)
            named = [rank for rank, record in enumerate(records) if record.get("step", 0) == lowest]
            why = "stopped arriving (every rank waits; see their stacks for where)"
        waited = min(now - self.seen[rank].progress_at for rank in named)
        where = "; ".join(
            f"rank {rank} (pid {records[rank].get('pid')} on {records[rank].get('host')}) last seen at step "
            f"{records[rank].get('step')} ({records[rank].get('phase')})"
            if records[rank]
            else f"rank {rank} (no heartbeat ever arrived from it)"
            for rank in named
        )
        ranks = ", ".join(map(str, named))
        message = f"hang: rank{'s' if len(named) > 1 else ''} {ranks} {why}, no progress for {waited:.0f} s: {where}"
        return {"message": message, "frozen": frozen, "by": self.rank}

    def _end(self, verdict: dict, reachable: bool = True) -> None:
        self._dump()
        if reachable:
            try:
                self.store.set(DUMPED.format(self.rank), "1")
            except Exception:  # noqa: BLE001 - the store is gone: the stacks are written all the same
                pass
        popen_child = watchdog.LAUNCHER_PID in os.environ
        if self.children is not None:  # the popen launcher: report, kill the children, exit
            self._await_dumps(verdict)
            _report(verdict, self.directory)
            self.children.stop()
        elif popen_child and 0 in verdict.get("frozen", []):  # the launcher itself stopped: end it
            _report(verdict, self.directory)
            os.kill(int(os.environ[watchdog.LAUNCHER_PID]), signal.SIGKILL)
        elif popen_child:
            time.sleep(3 * DUMP_WAIT_S)  # rank 0 reports and kills this process; if it does not, exit
        elif verdict.get("by") == self.rank:  # torchrun, SLURM: every rank exits; the one that saw it first reports
            self._await_dumps(verdict)
            _report(verdict, self.directory)
        sys.stderr.flush()
        os._exit(1)

    def _await_dumps(self, verdict: dict) -> None:
        expected = [rank for rank in range(self.world_size) if rank not in verdict.get("frozen", [])]
        deadline = time.monotonic() + DUMP_WAIT_S
        while time.monotonic() < deadline:
            try:
                if self.store.check([DUMPED.format(rank) for rank in expected]):
                    return
            except Exception:  # noqa: BLE001
                return
            time.sleep(0.2)

    def _dump(self) -> None:
        """This rank's Python stacks (every thread) and torch's record of its last collectives, under `hang/`."""
        self.directory.mkdir(parents=True, exist_ok=True)
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        lines = [f"rank {self.rank} (pid {os.getpid()} on {socket.gethostname()}), {time.strftime('%H:%M:%S')}"]
        for ident, frame in sys._current_frames().items():
            lines += ["", f"thread {names.get(ident, ident)}:", *traceback.format_stack(frame)]
        (self.directory / f"rank{self.rank}-stacks.txt").write_text("\n".join(lines))
        try:
            trace = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True)
            (self.directory / f"rank{self.rank}-collectives.json").write_bytes(trace)
        except Exception as error:  # noqa: BLE001 - a torch without the flight recorder: the stacks still help
            (self.directory / f"rank{self.rank}-collectives.json").write_text(json.dumps({"unavailable": str(error)}))
        with open(self.directory / f"rank{self.rank}-stacks.txt", "a") as file:  # C-level frames too
            faulthandler.dump_traceback(file, all_threads=True)


def _report(verdict: dict, directory: Path) -> None:
    written = sorted(path.name.split("-")[0] for path in directory.glob("rank*-stacks.txt"))
    print(
        f"\nerror: {verdict['message']}; stacks and last collectives of {', '.join(written) or 'no rank'} in "
        f"{directory}; stopping the job",
        file=sys.stderr,
        flush=True,
    )
