"""The zoo's init column (`python -m tp_train.tools.zoo --init`, issue 54): a family built under `deferred_init` and
sharded matches its eager build's initialisation tensor by tensor, and one whose rule is lost is `differs`, naming the
tensor and its standard deviation."""

from __future__ import annotations

import re

import pytest
import torch

from tests.distributed import run_on_ranks
from tp_train.tools.zoo import run_zoo
from tp_train.tools.zoo.init_check import check_init, init_mismatches, init_summary


def test_the_size_scaled_tolerance_passes_another_draw_and_catches_a_lost_rule_on_tiny_shapes():
    generator = torch.Generator().manual_seed(0)
    eager = {name: torch.randn(32, 32, generator=generator) * 0.02 for name in ("a", "b", "c")}
    eager["zeros"], eager["position_ids"] = torch.zeros(32), torch.arange(8)
    built = {name: torch.randn(32, 32, generator=generator) * 0.02 for name in ("a", "b", "c")}
    built["zeros"], built["position_ids"] = torch.zeros(32), torch.arange(8)
    assert init_mismatches(eager, built) == {}
    built["a"] = built["a"] * 1.4  # mamba2's lost out_proj rule (0.071 -> 0.099); the bar is 4 / sqrt(2 * 1024)
    built["b"] = built["b"] + 0.01  # a shifted mean
    built["zeros"] = torch.full((32,), 1e-3)
    del built["c"]
    found = init_mismatches(eager, built)
    assert list(found) == ["a", "b", "c", "zeros"], found
    assert found["c"] == "missing from the sharded model" and found["zeros"] == "a constant tensor, not equal"


def _checked(rank, world_size, families, lose_rules=False):
    """Each family's init check on this rank. With `lose_rules`, the meta build makes only the first write recorded
    on each tensor again: a lost rule, as Hugging Face's `post_init` rescaling GPT-2's residual projections after
    the constructor drew them."""
    from tp_train.plan import meta_init

    replay = meta_init.replay
    if lose_rules:
        meta_init.replay = lambda writes, tensor, computed: replay(writes[:1], tensor, computed)
    try:
        return {family: check_init(family) for family in families}
    finally:
        meta_init.replay = replay


def test_the_zoos_init_check_matches_eager_builds_at_tp_2():
    results = run_on_ranks(_checked, 2, ["gpt2", "mamba"])[0]
    for family, result in results.items():
        assert result["class"] == "match", (family, result)


def test_a_family_whose_init_rule_is_lost_differs_naming_the_tensor():
    result = run_on_ranks(_checked, 2, ["gpt2"], True)[0]["gpt2"]
    assert result["class"] == "differs", result
    lost = [line for line in result["tensors"] if ".c_proj.weight: std" in line]
    assert len(lost) == 4, result["tensors"]  # attention and MLP projections of both layers
    for line in lost:  # GPT-2's 1 / sqrt(2 n_layer) lost: 0.01 -> 0.02, at every seed
        before, after = map(float, re.search(r"pooled, std (\S+) -> (\S+),", line).groups())
        assert 1.8 < after / before < 2.2, line


@pytest.mark.slow
def test_the_zoo_runs_the_init_check_per_family_and_counts_it():
    results = run_zoo(["gpt2"], tp=2, jobs=1, timeout=300, echo=lambda line: None, check=check_init)
    assert results["gpt2"]["class"] == "match", results
    text = init_summary(results, tp=2)
    assert (
        text == "1 of 1 buildable families match their eager initialisation at tp=2; differs 0, refused 0, "
        "error 0, killed 0; 0 not buildable from a tiny config"
    ), text
