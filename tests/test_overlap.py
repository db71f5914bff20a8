"""Backward overlap (`tp_train.parallel.overlap`): a column-parallel layer's input-gradient collective runs while
its weight gradient is computed. The sharded model with overlap computes the unsharded model's function (outputs,
every gradient, losses over steps) at tp 1, 2 and 4, with sequence parallelism, frozen weights (some layers' and
whole entries', and inputs that need no gradient), no biases and gradient accumulation; its collectives are the
plain path's, call for call and byte for byte; and the backward really starts the collective before the weight
gradient's matmul and waits for it after, seen in the profiler's timeline."""

from __future__ import annotations

import copy
import functools
import time

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, full_tensors, next_token_loss, parity_errors
from tests.test_parallelize import VOCAB, _hf_llama, _hf_logits, _logits

ATOL = 1e-5
FROZEN = ("tok_emb.weight", "pos_emb.weight", "blocks.0.ln_1.weight", "blocks.0.ln_1.bias")  # block 0's input
FROZEN += ("blocks.0.mlp.fc.weight", "blocks.1.attn.k.weight", "blocks.1.attn.v.bias")  # one layer's parameter
FROZEN += tuple(f"blocks.1.attn.q.{name}" for name in ("weight", "bias"))  # a whole layer of a shared entry


def _gpt(bias: bool = True, frozen: tuple[str, ...] = ()):
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0, bias=bias))
    for name, param in model.named_parameters():
        param.requires_grad_(name not in frozen)
    return model


VARIANTS = {
    "gpt": (_gpt, _logits, {}),
    "gpt-sequence_parallel": (_gpt, _logits, dict(sequence_parallel=True)),
    "gpt-no_bias": (functools.partial(_gpt, bias=False), _logits, {}),
    "gpt-frozen": (functools.partial(_gpt, frozen=FROZEN), _logits, {}),
    "gpt-frozen-sequence_parallel": (functools.partial(_gpt, frozen=FROZEN), _logits, dict(sequence_parallel=True)),
    "llama-sequence_parallel": (_hf_llama, _hf_logits, dict(sequence_parallel=True)),  # GQA, no biases, SwiGLU
}


def _accumulated_gradients(build, forward, kwargs) -> dict[str, float]:
    """Max-abs errors of gradients accumulated over two micro-batches (no zero_grad between them)."""
    torch.manual_seed(0)
    reference = build()
    model = tp_train.parallelize(copy.deepcopy(reference), verify=False, **kwargs)
    generator = torch.Generator().manual_seed(7)
    for _ in range(2):
        idx = torch.randint(0, VOCAB, (2, 16), generator=generator)
        next_token_loss(forward(reference, idx), idx).backward()
        next_token_loss(forward(model, idx), idx).backward()
    grads = full_tensors(model, dist.group.WORLD, grads=True)
    reference_grads = {name: p.grad for name, p in reference.named_parameters()}
    return {
        f"accumulated:{name}": (reference_grads[name] - grad).abs().max().item()
        for name, grad in grads.items()
        if grad is not None or reference_grads[name] is not None
    }


def _parity(rank, world_size):
    results = {}
    for variant, (build, forward, kwargs) in VARIANTS.items():
        if world_size == 1 and "sequence_parallel" in variant:
            continue
        torch.manual_seed(0)
        errors = parity_errors(build(), forward, VOCAB, parallelize_kwargs=dict(overlap=True, **kwargs))
        if variant in ("gpt", "gpt-frozen-sequence_parallel"):
            errors.update(_accumulated_gradients(build, forward, kwargs))
        results[variant] = errors
    return results


@functools.cache
def _parity_run(tp: int):
    return run_on_ranks(_parity, tp, timeout=300)


CASES = [(tp, variant) for tp in (1, 2, 4) for variant in VARIANTS if tp > 1 or "sequence_parallel" not in variant]


@pytest.mark.parametrize("tp,variant", CASES, ids=[f"tp{tp}-{variant}" for tp, variant in CASES])
def test_overlap_matches_unsharded(tp, variant):
    for rank, results in enumerate(_parity_run(tp)):
        assert_parity(results[variant], tp, rank, ATOL)


# --------------------------------------------------------------------------------------- the same collectives


def _traffic(rank, world_size):
    """The comm counter's calls and bytes over one training step, with and without overlap."""
    out = {}
    for frozen in ((), FROZEN):  # frozen: block 0's attention input needs no gradient, so no collective
        for sequence_parallel in (False, True):
            for overlap in (False, True):
                torch.manual_seed(0)
                model = _gpt(frozen=frozen)
                model = tp_train.parallelize(model, sequence_parallel=sequence_parallel, overlap=overlap, verify=False)
                idx = torch.randint(0, VOCAB, (2, 16))
                next_token_loss(model(idx), idx).backward()
                counter = model.tp_comm_counter
                out[bool(frozen), sequence_parallel, overlap] = (counter.calls, counter.bytes)
    return out


def test_overlap_moves_the_same_collectives():
    traffic = run_on_ranks(_traffic, 2)[0]
    n_layer = 2
    for frozen in (False, True):
        for sequence_parallel in (False, True):
            assert traffic[frozen, sequence_parallel, True] == traffic[frozen, sequence_parallel, False], traffic
    # Megatron's minimum: per block 2 all-reduces forward and 2 backward, plus the embedding's all-reduce and the
    # head's entry (backward) and gather; under sequence parallelism each all-reduce is an all-gather and a
    # reduce-scatter, plus the scatter into the region (all-gather backward).
    assert traffic[False, False, True][0] == 4 * n_layer + 3, traffic
    assert traffic[False, True, True][0] == 8 * n_layer + 5, traffic
    assert traffic[True, False, True][0] < traffic[False, False, True][0], traffic  # what needs no gradient


# ------------------------------------------------------------------------------------------ the overlap is real

LATE = 0.3  # seconds rank 1 starts its backward's collective after rank 0 does


def _timeline(rank, world_size, input_layout, overlap):
    """Rank 0's backward of one column-parallel layer, with rank 1 late to the collective: the main thread's
    collective launches and matmuls, and the backend thread's collectives, as (name, start, end) in microseconds.

    While rank 1 is late, rank 0's collective cannot finish: whatever rank 0's main thread runs between its launch
    and the collective's end ran while it was in flight."""
    from tp_train.parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    layer = ColumnParallelLinear(32, 64, dist.group.WORLD, input_layout=input_layout, overlap=overlap)
    tokens = 16 // world_size if input_layout == "sequence_sharded" else 16
    x = torch.randn(2, tokens, 32, requires_grad=True)
    y = layer(x)
    if rank == 1:
        y.register_hook(lambda grad: time.sleep(LATE))
    loss = y.square().sum()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    main = {e.thread for e in prof.events() if e.name.startswith("c10d::")}
    launches = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.name.startswith("c10d::")]
    matmuls = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.name == "aten::mm"]
    collectives = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name.startswith("gloo:") and e.thread not in main
    ]
    return launches, matmuls, collectives


@pytest.mark.parametrize("input_layout", ["replicated", "sequence_sharded"])
def test_backward_computes_the_weight_gradient_while_the_collective_runs(input_layout):
    launches, matmuls, collectives = run_on_ranks(_timeline, 2, input_layout, True)[0]
    assert len(launches) == 1 and len(collectives) == 1, (launches, collectives)
    (_, launched, _), (_, _, finished) = launches[0], collectives[0]
    during = [start for _, start, _ in matmuls if launched < start < finished]
    assert during, f"no matmul ran while the collective was in flight: {launches} {collectives} {matmuls}"
    assert finished - launched > LATE * 1e6 / 2  # the collective did wait for the late rank


def test_without_overlap_nothing_runs_during_the_collective():
    """The same timeline without overlap: the weight gradient comes before the collective (what the test above
    tells apart)."""
    launches, matmuls, collectives = run_on_ranks(_timeline, 2, "replicated", False)[0]
    (_, launched, _), (_, _, finished) = launches[0], collectives[0]
    assert not [start for _, start, _ in matmuls if launched < start < finished]
    assert len(matmuls) == 2


# ------------------------------------------------------------------------------------------- mixed precision


def _autocast_gradients(rank, world_size, sequence_parallel):
    """Under bf16 autocast, the sharded model's loss and gradients with and without overlap."""
    out = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        model = tp_train.parallelize(_gpt(), sequence_parallel=sequence_parallel, overlap=overlap, verify=False)
        idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = next_token_loss(model(idx), idx)
        loss.backward()
        grads = full_tensors(model, dist.group.WORLD, grads=True)
        assert all(grad.dtype == torch.float32 for grad in grads.values())  # the parameters' dtype
        out[overlap] = loss.item(), grads
    (loss_off, grads_off), (loss_on, grads_on) = out[False], out[True]
    return abs(loss_on - loss_off), max((grads_on[k] - grads_off[k]).abs().max().item() for k in grads_off)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sequence_parallel"])
def test_overlap_under_autocast_casts_as_the_plain_path(sequence_parallel):
    """bf16 matmuls, fp32 gradients: the plain path's numbers exactly (the same ops on the same operands)."""
    for loss_error, grad_error in run_on_ranks(_autocast_gradients, 2, sequence_parallel):
        assert loss_error == 0.0 and grad_error == 0.0, (loss_error, grad_error)


# -------------------------------------------------------------------------------------------------- Lightning


def _lightning(rank, world_size):
    """Trains through `TensorParallelStrategy(overlap=...)` both ways: the losses, and the setting its layers got."""
    from tests.lightning_helpers import fit
    from tp_train.parallel.layers import ColumnParallelLinear

    out = {}
    for overlap in (True, False):
        trainer, recorder = fit(2, 3, accumulate_grad_batches=2, strategy_kwargs=dict(overlap=overlap))
        layers = [m for m in trainer.lightning_module.modules() if isinstance(m, ColumnParallelLinear)]
        out[overlap] = recorder.losses, {layer.overlap for layer in layers}
    return out


def test_strategy_passes_overlap_to_its_layers():
    for result in run_on_ranks(_lightning, 2, timeout=300):
        (losses_on, setting_on), (losses_off, setting_off) = result[True], result[False]
        assert setting_on == {True} and setting_off == {False}
        assert len(losses_on) == 6 and losses_on == pytest.approx(losses_off, abs=1e-6)


# ------------------------------------------------------------------------------------------ the default


def _overlap_settings(rank, world_size):
    from tp_train.parallel.layers import ColumnParallelLinear

    torch.manual_seed(0)
    settings = {}
    for overlap in (None, True, False):
        model = tp_train.parallelize(_gpt(), overlap=overlap, verify=False)
        settings[str(overlap)] = {m.overlap for m in model.modules() if isinstance(m, ColumnParallelLinear)}
    return settings


def test_overlap_is_off_by_default_on_gloo_and_the_flag_still_sets_it():
    """On with NCCL only: gloo's collectives take the CPU cores the compute runs on (slower in the benchmark)."""
    settings = run_on_ranks(_overlap_settings, 2)[0]
    assert settings == {"None": {False}, "True": {True}, "False": {False}}, settings
