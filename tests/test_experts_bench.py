"""The expert-parallel benchmark runs end to end on gloo ranks: one process, tensor-parallel experts and
expert parallelism over the same global batch, each rank's parameters and collective bytes counted. Which wins is
the benchmark's to report (docs/experts.md), never a timed assertion here."""

from __future__ import annotations

import json

from tp_train.tools.bench.experts import main


def test_experts_bench_compares_ep_with_tensor_parallel_experts(tmp_path, capsys):
    output = tmp_path / "experts.json"
    tiny = ["--layers", "1", "--width", "32", "--heads", "4", "--kv-heads", "2", "--expert-hidden", "32"]
    main([*tiny, "--ranks", "2", "--seq", "16", "--batch", "4", "--steps", "1", "--output", str(output)])
    one, tp, ep = json.loads(output.read_text())["rows"]
    assert (one["setup"], tp["setup"], ep["setup"]) == ("one process", "tp=2", "ep=2")
    assert one["collective_mib_per_rank"] == 0 < ep["collective_mib_per_rank"]
    assert tp["collective_mib_per_rank"] > 0
    # tensor parallelism splits every matrix, expert parallelism only the experts: each holds less than one process
    assert tp["parameters_mib_per_rank"] < ep["parameters_mib_per_rank"] < one["parameters_mib_per_rank"]
    assert all(row["tokens_per_s"] > 0 for row in (one, tp, ep))
    assert "| ep=2 | 2 |" in capsys.readouterr().out
