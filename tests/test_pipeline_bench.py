"""The pipeline benchmark runs end to end on gloo ranks and writes its JSON, SVG and table: each rank's timeline of
stage work lies inside its step (busy time above 0 and at most the step's wall time), beside the textbook bubble.
The bubble's size is the benchmark's to report (docs/pipeline-parallelism.md), never a timed assertion here."""

from __future__ import annotations

import json
from enum import Enum
from types import SimpleNamespace
from typing import NamedTuple

from tp_train.tools.bench.pipeline import formula, main
from tp_train.tools.bench.pipeline_timeline import simulated_bubble


def test_formula_is_the_textbook_bubble():
    assert formula(1, "one process", 1, 8) == 0.0
    assert formula(4, "1f1b", 1, 8) == formula(4, "gpipe", 1, 8) == 3 / 8
    assert formula(4, "interleaved_1f1b", 2, 8) == 3 / 16
    assert formula(2, "zbv_zero_bubble", 2, 8) is None


class Kind(str, Enum):  # torch's action letters
    F = "F"
    B = "B"


class Action(NamedTuple):  # the fields of torch's _Action that the simulation reads
    stage_index: int
    computation_type: Kind
    microbatch_index: int


def test_simulated_bubble_runs_the_table_with_the_measured_chunk_times():
    """1F1B's table over 2 stages and 2 microbatches, a forward 1 s and a backward 2 s: rank 1 runs F0 1-2, B0 2-4,
    F1 4-5, B1 5-7; rank 0 F0 0-1, F1 1-2, B0 4-6 (after rank 1's B0), B1 7-9. Each works 6 s of 9: idle 3 / 6,
    the textbook's (p - 1) / m; the None slots of the table cost nothing."""
    F, B = Kind.F, Kind.B
    order = {0: [Action(0, F, 0), Action(0, F, 1), None, Action(0, B, 0), Action(0, B, 1)],
             1: [None, Action(1, F, 0), Action(1, B, 0), Action(1, F, 1), Action(1, B, 1)]}  # fmt: skip
    durations = {("forward_one_chunk", s): 1.0 for s in (0, 1)} | {("backward_one_chunk", s): 2.0 for s in (0, 1)}
    assert simulated_bubble(SimpleNamespace(pipeline_order=order), durations, 2) == 0.5
    # the loss on the last stage counts as its forward's work: rank 1 works 7 s of 10, rank 0 6 s
    with_loss = simulated_bubble(SimpleNamespace(pipeline_order=order), durations | {("loss", 1): 0.5}, 2)
    assert abs(with_loss - (3 / 7 + 4 / 6) / 2) < 1e-12


def test_pipeline_bench_times_each_rank_stage_work(tmp_path, capsys):
    output = tmp_path / "pp.json"
    tiny = ["--layers", "4", "--width", "32", "--seq", "16", "--microbatches", "4", "--warmup", "1", "--steps", "1"]
    main([*tiny, "--setups", "2:1f1b,2:interleaved_1f1b", "--output", str(output)])
    rows = json.loads(output.read_text())["rows"]
    assert [(row["pp"], row["schedule"], row["virtual_stages"]) for row in rows] == [
        (2, "1f1b", 1),
        (2, "interleaved_1f1b", 2),
    ]
    for row in rows:
        assert len(row["busy_fraction_per_rank"]) == 2
        assert all(0 < fraction <= 1 for fraction in row["busy_fraction_per_rank"]), row
        assert row["tokens_per_s"] > 0 and row["peak_mib_per_rank"] >= 0
    assert [row["formula"] for row in rows] == [1 / 4, 1 / 8]
    assert rows[0]["schedule_table"] is None and rows[1]["schedule_table"] > 0  # torch's interleaved action table
    assert rows[0]["schedule_table_at_measured_chunks"] is None and rows[1]["schedule_table_at_measured_chunks"] > 0
    every_chunk = {f"{name} {stage}" for name in ("forward_one_chunk", "backward_one_chunk") for stage in range(4)}
    assert set(rows[1]["chunk_ms"]) == every_chunk | {"loss 3"}  # each stage's chunks, the loss on the last
    assert output.with_suffix(".svg").read_text().startswith("<svg")
    assert "| 2 | interleaved_1f1b" in capsys.readouterr().out
