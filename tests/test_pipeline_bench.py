"""The pipeline benchmark runs end to end on gloo ranks and writes its JSON, SVG and table: each rank's timeline of
stage work lies inside its step (busy time above 0 and at most the step's wall time), beside the textbook bubble.
The bubble's size is the benchmark's to report (docs/pipeline-parallelism.md), never a timed assertion here."""

from __future__ import annotations

import json

from tp_train.tools.bench.pipeline import formula, main


def test_formula_is_the_textbook_bubble():
    assert formula(1, "one process", 1, 8) == 0.0
    assert formula(4, "1f1b", 1, 8) == formula(4, "gpipe", 1, 8) == 3 / 8
    assert formula(4, "interleaved_1f1b", 2, 8) == 3 / 16
    assert formula(2, "zbv_zero_bubble", 2, 8) is None


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
    assert output.with_suffix(".svg").read_text().startswith("<svg")
    assert "| 2 | interleaved_1f1b" in capsys.readouterr().out
