"""The zoo tool (`python -m tp_train.tools.zoo`) classifies Hugging Face families: a family that shards right
passes, one the planner cannot plan is refused in one line with its reason, and the summary counts them."""

from __future__ import annotations

import pytest

from tp_train.tools.zoo import families, run_zoo, summary


def test_the_zoo_lists_every_causal_lm_family():
    names = families()
    assert {"llama", "gpt2", "bloom", "mamba"} <= set(names) and len(names) > 100


@pytest.mark.slow
def test_the_zoo_classifies_a_passing_and_a_refused_family():
    results = run_zoo(["gpt2", "rwkv"], tp=2, jobs=2, timeout=300, echo=lambda line: None)
    assert results["gpt2"]["class"] == "pass", results["gpt2"]
    assert results["rwkv"]["class"] == "refused", results["rwkv"]
    assert "\n" not in results["rwkv"]["reason"] and "rwkv.blocks.0" in results["rwkv"]["reason"]
    text = summary(results, tp=2)
    assert text.startswith("1 of 2 buildable families pass at tp=2 (50%); round-off 0, refused 1, WRONG 0"), text
    assert "refused  rwkv" in text
