"""Runs the 2-stage pipeline parity case (tests/test_pipeline.py) REPEATS times per schedule and counts hangs (a run
past its timeout) and failures: torch's pipelining is not tested upstream on gloo, so a hang would show here.

    .venv/bin/python -m tests.scripts.repeat_pipeline 50
"""

from __future__ import annotations

import sys
import time

from tests.distributed import run_on_ranks
from tests.test_pipeline import _errors, _train_pipeline


def main(repeats: int) -> None:
    for schedule, n_layer, microbatches in (("gpipe", 3, 2), ("1f1b", 3, 4)):
        hangs = failures = 0
        worst = 0.0
        started = time.monotonic()
        for _ in range(repeats):
            try:
                results = run_on_ranks(_train_pipeline, 2, n_layer, schedule, microbatches, 1, timeout=90)
            except TimeoutError:
                hangs += 1
                continue
            except RuntimeError:
                failures += 1
                continue
            worst = max(worst, *_errors(n_layer, results))
        seconds = time.monotonic() - started
        print(
            f"{schedule} pp=2: {repeats} runs, {hangs} hangs, {failures} failures, worst error {worst:.2e}, "
            f"{seconds:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)
