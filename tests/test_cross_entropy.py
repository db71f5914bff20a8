"""The vocabulary-parallel loss in chunks: exact against `F.cross_entropy` on the gathered logits (fp32, 1e-6) at tp
1, 2 and 4, over several chunks, with ignored targets, label smoothing and a padded vocabulary, the gradient written
into a new buffer or into the logits' own; float32 from bf16 logits, float64 from float64 ones (1e-12); and a
peak-memory bound that a full fp32 copy of the logits breaks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy

TOKENS = (3, 7)  # (batch, sequence): 21 tokens, chunks of 4 leave a short last one
PADDED_VOCAB = 40  # sharded 40 / tp wide at tp 1, 2, 4
EXACT = 1e-6
# (name, real vocabulary, ignore some targets, label smoothing, chunk size, in place)
CASES = [
    ("plain", PADDED_VOCAB, False, 0.0, None, False),
    ("chunks", PADDED_VOCAB, False, 0.0, 4, False),
    ("chunks_in_place", PADDED_VOCAB, True, 0.0, 4, True),
    ("ignore_smoothing", PADDED_VOCAB, True, 0.1, 4, False),
    ("padded_vocab_smoothing_in_place", 37, True, 0.1, 5, True),  # rank 3 of 4 holds 7 real columns of 10
    ("one_real_column_on_a_rank", 31, True, 0.2, 3, True),  # rank 3 of 4 holds column 30 and 9 of padding
]


def _reference(logits, target, vocab_size, label_smoothing, grad_scale):
    full = logits.clone().requires_grad_()
    loss = F.cross_entropy(full[..., :vocab_size].flatten(0, -2), target.flatten(), label_smoothing=label_smoothing)
    (grad_scale * loss).backward()
    return loss.detach(), full.grad  # the padding columns' gradient is zero


def _exactness(rank, world_size):
    group, errors = dist.group.WORLD, {}
    generator = torch.Generator().manual_seed(0)
    for name, vocab_size, ignore, smoothing, chunk, in_place in CASES:
        logits = 4 * torch.randn(*TOKENS, PADDED_VOCAB, generator=generator)
        logits[..., vocab_size:] += 6  # large padding columns: counting any of them changes the loss
        target = torch.randint(0, vocab_size, TOKENS, generator=generator)
        target.view(-1)[-1] = vocab_size - 1
        if ignore:
            target.view(-1)[[1, 5, 11]] = -100
        expected, expected_grad = _reference(logits, target, vocab_size, smoothing, 1.5)
        leaf = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
        local = leaf * 1  # not a leaf, as a head's output: the in-place gradient may take its buffer
        loss = vocab_parallel_cross_entropy(
            local, target, group, vocab_size, label_smoothing=smoothing, chunk_size=chunk, in_place_backward=in_place
        )
        (1.5 * loss).backward()
        errors[f"{name}/loss"] = (loss.detach() - expected).abs().item()
        errors[f"{name}/grad"] = (leaf.grad - expected_grad.chunk(world_size, dim=-1)[rank]).abs().max().item()

    # bf16 logits: the loss is float32 and F.cross_entropy's on the same values in fp32; the gradient is bf16.
    logits = (4 * torch.randn(*TOKENS, PADDED_VOCAB, generator=generator)).bfloat16()
    target = torch.randint(0, PADDED_VOCAB, TOKENS, generator=generator)
    expected, expected_grad = _reference(logits.float(), target, PADDED_VOCAB, 0.0, 1.0)
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, group, PADDED_VOCAB, chunk_size=4)
    loss.backward()
    errors["bf16/loss"] = (loss.detach() - expected).abs().item()
    expected_grad = expected_grad.chunk(world_size, dim=-1)[rank]
    errors["bf16/grad_in_bf16"] = (local.grad.float() - expected_grad).abs().max().item()
    bf16_grad_dtype = local.grad.dtype

    # fp64 logits (precision=64): the statistics in fp64 too, F.cross_entropy's loss and gradient to 1e-12
    logits = (4 * torch.randn(*TOKENS, PADDED_VOCAB, generator=generator)).double()
    expected64, expected_grad = _reference(logits, target, PADDED_VOCAB, 0.1, 1.0)
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    loss64 = vocab_parallel_cross_entropy(local, target, group, PADDED_VOCAB, label_smoothing=0.1, chunk_size=4)
    loss64.backward()
    errors["fp64/loss"] = (loss64.detach() - expected64).abs().item()
    errors["fp64/grad"] = (local.grad - expected_grad.chunk(world_size, dim=-1)[rank]).abs().max().item()
    return errors, (loss.dtype, loss64.dtype), (bf16_grad_dtype, local.grad.dtype)


@functools.cache
def _results(tp):
    return run_on_ranks(_exactness, tp, timeout=120)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_chunked_loss_equals_cross_entropy_of_gathered_logits(tp):
    for rank, (errors, loss_dtype, grad_dtype) in enumerate(_results(tp)):
        assert len(errors) == 2 * len(CASES) + 4, sorted(errors)
        exact = {key: value for key, value in errors.items() if not key.startswith(("bf16/", "fp64/"))}
        assert max(exact.values()) <= EXACT, (rank, {k: v for k, v in exact.items() if v > EXACT})
        assert errors["bf16/loss"] <= 1e-5, (rank, errors["bf16/loss"])
        assert errors["bf16/grad_in_bf16"] <= 4e-3, (rank, errors["bf16/grad_in_bf16"])  # bf16's rounding
        assert loss_dtype == (torch.float32, torch.float64) and grad_dtype == (torch.bfloat16, torch.float64)
        assert max(errors["fp64/loss"], errors["fp64/grad"]) <= 1e-12, (rank, errors["fp64/loss"], errors["fp64/grad"])


ROWS, COLUMNS, WIDTH, CHUNK = 2048, 8192, 64, 128  # bf16 logits of 32 MiB from a narrow head; fp32 chunks of 4 MiB


def _peak_growth(rank, world_size, in_place):
    """Peak bytes allocated while a head's logits are made and the loss runs forward and backward (torch.profiler's
    allocator events: every tensor allocation and free on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(ROWS, WIDTH, generator=generator).bfloat16().requires_grad_()
    weight = torch.randn(COLUMNS, WIDTH, generator=generator).bfloat16().requires_grad_()
    target = torch.randint(0, COLUMNS, (ROWS,), generator=generator)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = hidden @ weight.T  # the head: its backward needs no logits-sized buffer of its own
        loss = vocab_parallel_cross_entropy(
            logits, target, dist.group.WORLD, COLUMNS, chunk_size=CHUNK, in_place_backward=in_place
        )
        del logits
        loss.backward()
    events = [event for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    running = peak = 0
    for event in sorted(events, key=lambda event: event.start_ns()):
        running += event.nbytes()
        peak = max(peak, running)
    return peak, loss.dtype


@pytest.mark.parametrize("in_place", [True, False])
def test_loss_never_holds_a_full_fp32_copy_of_the_logits(in_place):
    logits_bytes = ROWS * COLUMNS * 2
    [(peak, loss_dtype)] = run_on_ranks(_peak_growth, 1, in_place)
    # The bf16 logits, their gradient (in their own buffer when in place, else a second one) and a few fp32 chunks;
    # a full fp32 copy alone is twice the logits.
    bound = (1 if in_place else 2) * logits_bytes + 4 * CHUNK * COLUMNS * 4
    assert loss_dtype == torch.float32
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > {bound / 2**20:.1f} MiB"


HIDDEN = 6  # the head's input width


def _fused_exactness(rank, world_size):
    """The fused head + loss against `F.cross_entropy` of the full head's logits: loss, input and weight gradients."""
    from tp_train.parallel.collectives import copy_to_tensor_parallel_region
    from tp_train.parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy

    group, errors = dist.group.WORLD, {}
    generator = torch.Generator().manual_seed(1)
    for name, vocab_size, ignore, smoothing, chunk, _ in CASES:
        hidden = torch.randn(*TOKENS, HIDDEN, generator=generator)
        weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=generator)  # padding rows: never in the softmax
        target = torch.randint(0, vocab_size, TOKENS, generator=generator)
        if ignore:
            target.view(-1)[[1, 5, 11]] = -100
        full_hidden, full_weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = full_hidden @ full_weight[:vocab_size].T
        expected = F.cross_entropy(logits.flatten(0, -2), target.flatten(), label_smoothing=smoothing)
        (1.5 * expected).backward()

        local_hidden = hidden.clone().requires_grad_()
        local_weight = weight.chunk(world_size)[rank].clone().requires_grad_()
        entered = copy_to_tensor_parallel_region(local_hidden, group)  # the head's entry: all-reduce backward
        loss = vocab_parallel_linear_cross_entropy(
            entered, local_weight, target, group, vocab_size, label_smoothing=smoothing, chunk_size=chunk
        )
        (1.5 * loss).backward()
        errors[f"{name}/loss"] = (loss.detach() - expected.detach()).abs().item()
        errors[f"{name}/input_grad"] = (local_hidden.grad - full_hidden.grad).abs().max().item()
        expected_weight_grad = full_weight.grad.chunk(world_size)[rank]
        errors[f"{name}/weight_grad"] = (local_weight.grad - expected_weight_grad).abs().max().item()

    # float64 (precision=64): the head and the statistics in float64, F.cross_entropy's to 1e-12
    hidden = torch.randn(*TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    weight = torch.randn(PADDED_VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    target = torch.randint(0, PADDED_VOCAB, TOKENS, generator=generator)
    full_weight = weight.clone().requires_grad_()
    expected = F.cross_entropy((hidden @ full_weight.T).flatten(0, -2), target.flatten())
    expected.backward()
    local_weight = weight.chunk(world_size)[rank].clone().requires_grad_()
    loss64 = vocab_parallel_linear_cross_entropy(hidden, local_weight, target, group, PADDED_VOCAB, chunk_size=4)
    loss64.backward()
    errors["fp64/loss"] = (loss64.detach() - expected.detach()).abs().item() * 1e6  # held to 1e-12 as 1e-6
    errors["fp64/weight_grad"] = (local_weight.grad - full_weight.grad.chunk(world_size)[rank]).abs().max().item() * 1e6
    return errors, (loss.dtype, loss64.dtype)


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_fused_head_and_loss_equal_cross_entropy_of_the_full_head(tp):
    for rank, (errors, loss_dtype) in enumerate(run_on_ranks(_fused_exactness, tp, timeout=120)):
        assert len(errors) == 3 * len(CASES) + 2, sorted(errors)
        assert max(errors.values()) <= EXACT, (rank, {k: v for k, v in errors.items() if v > EXACT})
        assert loss_dtype == (torch.float32, torch.float64)


def _fused_memory(rank, world_size):
    """The fused head and loss over 1024 and 4096 tokens under bf16 autocast, a head 256 wide over 2048 columns in
    chunks of 64 tokens: raw peak and working memory (above its inputs and the gradients it returns), measured by
    the benchmark's own code (tools/bench/fused_memory.py)."""
    from tp_train.tools.bench.fused_memory import fused_memory

    return [fused_memory(tokens, 256, 2048, 64, True, torch.device("cpu")) for tokens in (1024, 4096)]


@pytest.mark.slow
def test_fused_head_and_loss_working_memory_follows_the_chunk_not_the_tokens():
    [(short, long)] = run_on_ranks(_fused_memory, 1)
    # Working memory (4.8 and 4.9 MiB): the same at 4x the tokens, where a bf16 copy of the whole input (0.5 MiB at
    # 1024 tokens, 2 at 4096) breaks the 10%; and far below a full-sequence fp32 logits buffer (32 MiB at 4096
    # tokens; a bf16 one, 16 MiB, breaks it too).
    assert long["working_bytes"] <= 1.1 * short["working_bytes"], (short, long)
    assert long["working_bytes"] < long["full_fp32_logits_bytes"] / 4, long
    # What grows with the tokens is the input's gradient, returned in the input's dtype (fp32): 3072 x 256 x 4 bytes.
    assert long["returned_gradients_bytes"] - short["returned_gradients_bytes"] == 3072 * 256 * 4
    assert long["gradients_allocated_first"] and short["gradients_allocated_first"]
