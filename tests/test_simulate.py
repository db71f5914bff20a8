"""The step simulator (`tp_train.simulate_memory`): one training step of a layout run on fake ranks in this process
holds what real gloo ranks measure, rank by rank, and the model states the exact formula gives under DDP and FSDP2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_train
from models import GPT, GPTConfig, MoEConfig, MoEGPT
from tests.distributed import run_on_ranks
from tests.test_memory import PEAK_CASES, PEAK_VOCAB, _measured_and_estimated_peaks
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.training.apply_order import TrainingOptions

# gpt_tiny's shape in fp32 and under bf16 autocast (gpt_small's measured step costs ~30 s a precision here).
TINY_CASES = [case for case in PEAK_CASES if case[:2] == (4, 128)]


def _dims(world_size: int, **degrees) -> tp_train.ParallelDims:
    dims = tp_train.ParallelDims.from_world(world_size, **degrees)
    dims.validate()
    return dims


def _simulated_peak(case: tuple, tp: int, rank: int) -> int:
    """The peak bytes of the measured step of test_memory (`_measured_and_estimated_peaks`), simulated."""
    layers, width, heads, batch, seq, precision = case
    config = GPTConfig(vocab_size=PEAK_VOCAB, block_size=seq, n_layer=layers, n_head=heads, n_embd=width)

    def forward_backward(model):  # as `TrainingStep`: autocast over the forward, the loss and the backward
        idx = torch.randint(0, PEAK_VOCAB, (batch, seq + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
            logits = model(idx[:, :-1])
            vocab_parallel_cross_entropy(
                logits, idx[:, 1:], group=dist.group.WORLD, vocab_size=PEAK_VOCAB, in_place_backward=True
            ).backward()

    options = TrainingOptions(loss_parallel=True)
    return tp_train.simulate_memory(lambda: GPT(config), _dims(tp, tp=tp), forward_backward, options, rank=rank).peak


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_simulated_peak_is_what_each_real_rank_measures(tp):
    """Measured as the benchmark measures (the profiler's allocator events on real gloo ranks, in test_memory);
    2026-12-07: equal to 0.1 MiB at tp 1 and 2 (24.0 MiB at tp=2 fp32, 26.2-26.5 under bf16 autocast)."""
    measured = run_on_ranks(_measured_and_estimated_peaks, tp, TINY_CASES, timeout=300)
    for rank, results in enumerate(measured):
        for case, (*_, peak, _estimate) in zip(TINY_CASES, results, strict=True):
            simulated = _simulated_peak(case, tp, rank)
            assert abs(simulated / peak - 1) <= 0.02, (case, tp, rank, simulated, peak)


def _tiny_gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=128, block_size=32, n_layer=2, n_head=4, n_embd=64))


def _next_token_step(model) -> None:
    idx = torch.randint(0, 128, (2, 33))
    F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()


@pytest.mark.parametrize(
    "world_size, tp, data_parallel", [(4, 2, "ddp"), (4, 2, "fsdp"), (4, 1, "fsdp"), (8, 4, "ddp")]
)
def test_data_parallel_model_states_are_the_exact_bytes_of_the_sharded_tensors(world_size, tp, data_parallel):
    """FSDP2 and DDP as the strategy applies them, over a world this process does not have: the optimizer states are
    the sharded parameters' exact bytes (estimate_memory's, tested exact on real ranks in test_memory), and DDP adds
    one flat copy of the gradients."""
    dims = _dims(world_size, tp=tp, data_parallel=data_parallel)
    simulated = tp_train.simulate_memory(
        _tiny_gpt, dims, _next_token_step, TrainingOptions(data_parallel=data_parallel)
    )
    with torch.device("meta"):
        model = _tiny_gpt()
        formula = tp_train.estimate_memory(model, 2, 32, tp=tp, dp=dims.dp, data_parallel=data_parallel)
    steps = 4 * len(list(model.parameters()))  # AdamW's step counts (an fp32 scalar a parameter), not in the formula
    assert simulated.optimizer_states == formula.optimizer_states + steps
    assert simulated.gradient_buckets == formula.gradient_buckets
    assert simulated.parameters >= formula.parameters  # FSDP2 holds its gathered block's too at the peak


def test_a_layout_it_cannot_simulate_is_one_line():
    with pytest.raises(ValueError, match=r"^simulate_memory: pp=2 is not simulated yet; use estimate_memory"):
        tp_train.simulate_memory(_tiny_gpt, _dims(2, pp=2), _next_token_step)
    with pytest.raises(ValueError, match=r"^simulate_memory: rank=4 is outside the world of 4 ranks$"):
        tp_train.simulate_memory(_tiny_gpt, _dims(4, tp=2), _next_token_step, rank=4)
    config = MoEConfig(vocab_size=128, block_size=32, n_layer=1, n_head=4, n_embd=64, n_expert=4, top_k=2)
    with pytest.raises(ValueError, match=r"^simulate_memory: MoEGPT's step has a shape that depends on the data \("):
        tp_train.simulate_memory(lambda: MoEGPT(config), _dims(1), _next_token_step)
    assert not dist.is_initialized()  # nothing was left behind
