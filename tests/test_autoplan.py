"""The auto-planner: it finds the hand-written plans (models.GPT, the Hugging Face presets, HF Llama's own plan, the
test models), refuses in one line what it cannot be sure of, and a model planned by it alone matches the unsharded
model at tp 2 and 4 (with verification on, as it is by default for inferred plans). Also the docs' worked
example, run as written."""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from models import GPT, GPTConfig
from tests.distributed import free_port, run_on_ranks
from tests.docs_examples import example
from tests.parity import assert_parity, parity_errors
from tests.test_hf_families import FAMILIES
from tests.test_parallelize import ATOL, VOCAB, QKNormModel, SwiGLUModel, _gpt, _hf_gpt2, _hf_llama, _logits
from tests.test_plan import _hf_llama_kv
from tp_train.plan.deciding.resolve import find_plan, resolve_plan
from tp_train.plan.styles import ALIASES, pattern_matches

ROOT = Path(__file__).resolve().parents[1]

HAND_WRITTEN = {
    "gpt": _gpt,
    "hf_gpt2": _hf_gpt2,
    "hf_llama_gqa": _hf_llama,
    "custom_tp_plan": SwiGLUModel,
    "qk_norm": QKNormModel,
    **FAMILIES,
}
# Entries the auto-planner adds that the hand-written plan leaves out. HF's Llama plan has no `attention` entry
# (its forward takes head counts from shapes); the style is harmless there and gives dropout the sharded stream.
EXTRA = {"hf_llama_gqa": {"model.layers.*.self_attn": "attention"}}


def _per_module(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """The plan resolved to the module names it matches."""
    names = [name for name, _ in model.named_modules()]
    styles = {}
    for pattern, style in plan.items():
        styles.update({name: ALIASES.get(style, style) for name in names if pattern_matches(pattern, name)})
    return styles


# Every model at tp=2; at tp=4 those where the split depends on tp (fused [q; k; v], GQA, Falcon's kv groups).
CASES = [(name, 2) for name in HAND_WRITTEN] + [
    (name, 4) for name in ("gpt", "hf_gpt2", "hf_llama_gqa", "falcon_grouped_kv")
]


@pytest.mark.parametrize("name, tp", CASES)
def test_the_auto_planner_finds_the_hand_written_plan(name, tp):
    torch.manual_seed(0)
    model = HAND_WRITTEN[name]()
    hand_written, _ = find_plan(model)
    inferred = tp_train.infer_plan(model, tensor_parallel_size=tp)
    expected = _per_module(model, {**hand_written, **EXTRA.get(name, {})})
    assert _per_module(model, inferred) == expected


def test_a_meta_model_is_planned_on_a_probe_copy_and_left_untouched():
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32))
    rng = torch.random.get_rng_state()
    assert tp_train.infer_plan(model, tensor_parallel_size=2) == GPT.tp_plan
    assert all(param.is_meta for param in model.parameters())
    assert torch.equal(rng, torch.random.get_rng_state())  # same initial weights with or without the planner


class StridedHeads(nn.Module):
    """A fused qkv whose heads are strided (head h owns features h, h + H, ...): no contiguous, packed or [q; k; v]
    split gives a rank whole heads."""

    def __init__(self, vocab=VOCAB, dim=32, heads=4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].qkv, self.layers[0].out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = (t.view(B, T, -1, self.heads).permute(0, 3, 1, 2) for t in self.layers[0].qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(0, 2, 3, 1).reshape(B, T, -1)
        return self.head(x + self.layers[0].out(y))


class ScaledHidden(nn.Module):
    """An MLP whose hidden units are scaled by a learned vector: a parameter over the features a split would divide."""

    def __init__(self, vocab=VOCAB, dim=32, hidden=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([nn.Module()])
        self.blocks[0].fc, self.blocks[0].proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.blocks[0].scale = nn.Parameter(torch.ones(hidden))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        block = self.blocks[0]
        x = self.embed(idx)
        return self.head(x + block.proj(F.gelu(block.fc(x)) * block.scale))


class Unplanned(nn.Module):
    """Any model, wrapped so that no plan is found (no `tp_plan`, config or preset): the auto-planner plans it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids):
        out = self.inner(input_ids)
        return getattr(out, "logits", out)  # Hugging Face models return a ModelOutput


class _NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.up = nn.Embedding(VOCAB, 8), nn.Linear(8, 8)


REFUSALS = {
    "strided_heads": (
        StridedHeads,
        2,
        "the auto-planner cannot plan 'layers.0.qkv' (Linear 32->96): no split of 'layers.0.qkv' (colwise, "
        "packed_colwise, fused_qkv_colwise) at tp=2 gives each rank a share of its output that feeds only that rank's "
        "share of 'layers.0.out'",
    ),
    "kv_heads_neither_divide_nor_replicate": (  # 2 kv heads at tp=4 are replicated (test_kv_heads_from_reshape)
        lambda: Unplanned(_hf_llama_kv(3, heads=12, hidden=96)),
        4,
        "the auto-planner cannot plan 'inner.model.layers.0.self_attn.q_proj' (Linear 96->96): no split of "
        "'inner.model.layers.0.self_attn.k_proj' (colwise, packed_colwise, fused_qkv_colwise) at tp=4",
    ),
    "cannot_run": (_NoForward, 2, "the auto-planner could not run _NoForward on its probe input (input (1, 8))"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_what_the_auto_planner_cannot_be_sure_of_is_refused_in_one_line(name):
    build, tp, expected = REFUSALS[name]
    with pytest.raises(ValueError) as refusal:
        resolve_plan(build(), tensor_parallel_size=tp)
    message = str(refusal.value)
    assert expected in message and "give the model a `tp_plan`" in message and "\n" not in message, message


def _readme_example() -> str:
    """The worked example of docs/own-models.md (the README's own-model recipe saves it as mine.py)."""
    return example("custom-model")


def _readme_model() -> nn.Module:
    namespace = {"__name__": "readme_example"}
    exec(compile(_readme_example(), "docs/own-models.md", "exec"), namespace)
    return namespace["TinyLM"](vocab=VOCAB)


def _without_plan(build):
    def unplanned():
        model = build()
        return Unplanned(model)

    return unplanned


AUTO_PLANNED = {
    "qk_norm": _without_plan(QKNormModel),  # packed gate/up, a norm over local heads
    "hf_gpt2": _without_plan(_hf_gpt2),  # fused [q; k; v] Conv1D, tied head
    "hf_llama_gqa": _without_plan(_hf_llama),  # 8 q / 4 kv heads, gate/up, rotary
    "falcon_grouped_kv": _without_plan(FAMILIES["falcon_grouped_kv"]),  # fused, grouped per kv head
    "readme_tiny_lm": _without_plan(_readme_model),
}


def _auto_planned_parity(rank, world_size):
    results = {}
    for name, build in AUTO_PLANNED.items():
        torch.manual_seed(0)
        model = build()
        assert find_plan(model) is None  # the auto-planner is what is being tested
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            results[name] = parity_errors(model, _logits, VOCAB, parallelize_kwargs=dict(verify=True))
        results[name]["printed"] = printed.getvalue()
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def auto_planned_results(request):
    return request.param, run_on_ranks(_auto_planned_parity, request.param, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(AUTO_PLANNED))
def test_a_model_planned_by_the_auto_planner_alone_matches_unsharded(auto_planned_results, name):
    tp, per_rank = auto_planned_results
    for rank, results in enumerate(per_rank):
        errors = dict(results[name])
        printed = errors.pop("printed")
        assert ("tensor-parallel plan (inferred by the auto-planner):" in printed) == (rank == 0), printed
        assert_parity(errors, tp, rank, ATOL)


def test_the_readme_example_plan_is_what_the_auto_planner_finds():
    model = _readme_model()
    assert tp_train.infer_plan(model, tensor_parallel_size=2) == type(model).tp_plan


def _run_readme_script(rank, world_size):
    """The docs' worked example as a script: its `__main__` joins a process group from torchrun's environment variables
    (which the harness sets), so the harness's group makes way for it, on a fresh port."""
    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(_readme_example(), "docs/own-models.md", "exec"), {"__name__": "__main__"})
    return printed.getvalue(), dist.is_initialized()


@pytest.mark.slow
def test_the_readme_example_runs_as_a_script_on_two_ranks():
    for rank, (printed, still_initialized) in enumerate(run_on_ranks(_run_readme_script, 2)):
        assert f"rank {rank}: logits (2, 16, 256), 32 of q's 64 rows" in printed, printed
        assert not still_initialized  # it cleaned up after itself
