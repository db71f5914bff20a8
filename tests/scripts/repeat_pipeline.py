"""Runs the 2-stage pipeline parity case (tests/test_pipeline.py) REPEATS times per schedule and counts hangs (a run
past its timeout) and failures: torch's pipelining is not tested upstream on gloo, so a hang would show here.

    .venv/bin/python -m tests.scripts.repeat_pipeline 50 [gpipe] [1f1b]
"""

from __future__ import annotations

import sys
import time

from tests.distributed import run_on_ranks
from tests.test_pipeline import _errors, _train_pipeline


def main(repeats: int, schedules: list[str]) -> None:
    cases = {"gpipe": ("gpipe", 3, 2), "1f1b": ("1f1b", 3, 4)}
    for schedule, n_layer, microbatches in (cases[name] for name in schedules):
        hangs = failures = 0
        worst = 0.0
        started = time.monotonic()
        for run in range(repeats):
            try:
                results = run_on_ranks(_train_pipeline, 2, n_layer, schedule, microbatches, 1, timeout=90)
            except TimeoutError as error:
                hangs += 1
                print(f"  {schedule} run {run + 1}: HANG ({error})", flush=True)
                continue
            except RuntimeError as error:
                failures += 1
                print(f"  {schedule} run {run + 1}: FAILED ({str(error)[-300:]})", flush=True)
                continue
            worst = max(worst, *_errors(n_layer, results))
            print(f"  {schedule} run {run + 1}: ok, {time.monotonic() - started:.0f} s", flush=True)
        seconds = time.monotonic() - started
        print(
            f"{schedule} pp=2: {repeats} runs, {hangs} hangs, {failures} failures, worst error {worst:.2e}, "
            f"{seconds:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50, sys.argv[2:] or ["gpipe", "1f1b"])
