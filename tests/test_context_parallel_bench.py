"""The context-parallel benchmark runs end to end on gloo ranks, writes its JSON and SVG, and shows cp=2's activation
memory per rank at most 0.6x cp=1's at the same sequence length."""

from __future__ import annotations

import json

import pytest

from tp_train.tools.bench.context_parallel import main


@pytest.mark.slow
def test_cp2_activation_memory_per_rank_is_at_most_0_6_of_cp1(tmp_path, capsys):
    output = tmp_path / "cp.json"
    main(["--lengths", "64,128", "--setups", "cp=1,cp=2 ring", "--repeats", "1", "--output", str(output)])
    rows = json.loads(output.read_text())["rows"]
    assert output.with_suffix(".svg").read_text().startswith("<svg")
    memory = {(row["setup"], row["seq_len"]): row["activation_mib_per_rank"] for row in rows}
    for length in (64, 128):
        assert memory["cp=2 ring", length] <= 0.6 * memory["cp=1", length], memory
    assert "| cp=2 ring | 128 |" in capsys.readouterr().out
