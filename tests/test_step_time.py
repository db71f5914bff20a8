"""What a simulated step computes and sends (`tp_train.simulate_step`, counted by `tp_train.tools.step_counts`), and
the time model that prices it (`tp_train.tools.step_time`). The counts are held to what the layouts must do: the
tensor-parallel ranks' FLOPs add up to one process's, each block's all-reduces move its activations, FSDP2 gathers and
reduce-scatters every parameter, DDP all-reduces every gradient, a pipeline stage sends each microbatch's activations
on and receives their gradients back. All on fake ranks, in this process. The time model against measured steps is
the benchmark's (`python -m tp_train.tools.bench.step_time`, docs/performance.md), not a timed test."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import tp_train
from models import GPT, GPTConfig
from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.mesh import PIPELINE_PARALLEL, REPLICAS, TENSOR_PARALLEL
from tp_train.tools.hardware import CPU_HERE, GPU_PROFILES, profile_named
from tp_train.tools.simulate import DDP_BUCKET_BYTES, MIB, SimulatedMemory, ddp_buckets
from tp_train.tools.step_counts import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    POINT_TO_POINT,
    REDUCE_SCATTER,
    Collective,
    CollectiveCount,
    StepCounts,
)
from tp_train.tools.step_time import bubble_fraction, collective_seconds, predict_step_time, ring_steps, wire_bytes
from tp_train.tools.steps import language_model_step
from tp_train.training.apply_order import TrainingOptions

BATCH, SEQ, VOCAB, WIDTH, LAYERS = 4, 32, 256, 64, 2


def _gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=LAYERS, n_head=4, n_embd=WIDTH, dropout=0.0))


def _dims(world_size: int, **degrees) -> ParallelDims:
    dims = ParallelDims.from_world(world_size, **degrees)
    dims.validate()
    return dims


def _simulate(world_size: int, rank: int = 0, **degrees) -> tp_train.SimulatedStep:
    options = TrainingOptions(
        loss_parallel=True,
        data_parallel=degrees.pop("data_parallel", "ddp"),
        pipeline_microbatches=degrees.pop("m", None),
    )
    dims = _dims(world_size, data_parallel=options.data_parallel, **degrees)
    return tp_train.simulate_step(_gpt, dims, language_model_step(BATCH, SEQ, VOCAB), options, rank=rank)


def _parameter_bytes() -> int:
    with torch.device("meta"):
        return sum(p.numel() * p.element_size() for p in _gpt().parameters())


def _by(step: tp_train.SimulatedStep, kind: str, role: str) -> CollectiveCount:
    found = [count for key, count in step.collectives.items() if key.kind == kind and key.role == role]
    return found[0] if found else CollectiveCount()


def test_the_tensor_parallel_ranks_flops_add_up_to_one_process_s():
    """Each matrix product is split, none repeated: the FLOPs of tp=2's two ranks are one process's, which are
    torch's own count of the unsharded model's step."""
    with FlopCounterMode(display=False) as counter:
        model = _gpt()
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    one = _simulate(1)
    assert one.flops == counter.get_total_flops() > 0
    assert _simulate(2, 0, tp=2).flops + _simulate(2, 1, tp=2).flops == one.flops
    assert one.collectives == {}


def test_each_block_all_reduces_its_activations_forward_and_backward_at_tp2():
    """Megatron's f and g, on the tensor-parallel group: two all-reduces of a block's (batch, sequence, width)
    activations in its forward and two in its backward; one more each for the vocabulary-parallel embedding's output
    and the head's input gradient; and the vocabulary-parallel loss's two small ones (each token's max, then its sum
    of exponentials with its target's logit)."""
    step = _simulate(2, tp=2)
    activations, per_token = BATCH * SEQ * WIDTH * 4, BATCH * SEQ * 4
    assert step.collectives == {
        Collective(ALL_REDUCE, TENSOR_PARALLEL, (0, 1)): CollectiveCount(
            calls=4 * LAYERS + 2 + 2, bytes=(4 * LAYERS + 2) * activations + 3 * per_token
        )
    }


def test_data_parallel_collectives_move_every_parameter_and_gradient():
    """DDP all-reduces each gradient once (its buckets, counted by arithmetic); FSDP2 reduce-scatters each gradient
    once and all-gathers the parameters for the forward and again for the backward (the root's stay gathered)."""
    parameters = _parameter_bytes()
    ddp = _simulate(2, data_parallel="ddp")
    assert ddp.collectives == {
        Collective(ALL_REDUCE, REPLICAS, (0, 1)): CollectiveCount(ddp_buckets(parameters), parameters)
    }
    first = 1 * MIB  # DDP's first bucket is small (torch's _DEFAULT_FIRST_BUCKET_BYTES), the rest DDP_BUCKET_BYTES
    assert [
        ddp_buckets(n) for n in (0, 1, first, first + 1, first + DDP_BUCKET_BYTES, first + DDP_BUCKET_BYTES + 1)
    ] == [0, 1, 1, 2, 2, 3]
    fsdp = _simulate(2, data_parallel="fsdp")
    assert _by(fsdp, REDUCE_SCATTER, REPLICAS).bytes == parameters
    assert parameters < _by(fsdp, ALL_GATHER, REPLICAS).bytes < 2 * parameters


def test_a_pipeline_stage_sends_each_microbatch_on_and_receives_its_gradient_back():
    """The first of two stages sends each microbatch's hidden state on with its token ids (tp_train's stages pass
    the model's first input along) and receives the hidden state's gradient back."""
    microbatches = 2
    step = _simulate(2, 0, pp=2, m=microbatches)
    messages = _by(step, POINT_TO_POINT, PIPELINE_PARALLEL)
    assert messages.calls == 3 * microbatches
    assert messages.bytes == 2 * BATCH * SEQ * WIDTH * 4 + BATCH * SEQ * 8


def test_the_other_operations_are_counted_by_the_bytes_they_move_and_views_by_none():
    x = torch.ones(1000)
    with StepCounts() as counts:
        x.view(10, 100).t()  # views of x: nothing read or written
        x + 1  # reads x, writes a new tensor of its size
        x.mul_(2)  # in place: reads and writes x
    assert counts.memory_traffic == 2 * 4000 + 2 * 4000 and counts.flops == 0 and counts.operations == 4


def _step(flops: float, collectives: dict) -> tp_train.SimulatedStep:
    return tp_train.SimulatedStep(SimulatedMemory(0, 0, 0, 0, 0, 0, 0), int(flops), 0, 0, collectives)


def test_the_time_model_prices_compute_links_overlap_and_the_bubble():
    h100 = profile_named("h100-80gb")
    rate = h100.flops_per_s * h100.efficiency
    dims = _dims(16, tp=8)
    # a ring all-reduce sends 2 (n - 1) / n of its tensor; within a node over NVLink, across nodes over the network
    within = Collective(ALL_REDUCE, TENSOR_PARALLEL, tuple(range(8)))
    across = Collective(ALL_REDUCE, REPLICAS, (0, 8))
    assert wire_bytes(ALL_REDUCE, 8, 8_000) == 14_000 and wire_bytes(ALL_GATHER, 8, 8_000) == 7_000
    gigabyte = CollectiveCount(1, 10**9)
    waited = predict_step_time([_step(rate, {within: gigabyte})], dims, h100)
    assert waited.compute == pytest.approx(1.0)
    assert waited.communication == pytest.approx(14 * h100.latency_s + 1.75e9 / h100.intra_node_bytes_per_s)
    # the data-parallel all-reduce crosses nodes, and runs beside up to `overlap` of the compute
    for tensor_bytes in (10**9, 10**11):  # hidden whole; more than `overlap` of the second's compute, partly
        beside = predict_step_time([_step(rate, {across: CollectiveCount(1, tensor_bytes)})], dims, h100)
        crossing = 2 * h100.latency_s + tensor_bytes / h100.inter_node_bytes_per_s
        hidden = min(crossing, h100.overlap)
        assert beside.hidden_communication == pytest.approx(hidden) and beside.total == pytest.approx(
            1 + crossing - hidden
        )
    assert hidden == h100.overlap < crossing
    # a pipeline of 4 ranks and 8 microbatches idles 3/8 of its stages' mean work (2 stages per rank: 3/16)
    stages = [_step(rate, {}), _step(3 * rate, {})]
    assert (
        bubble_fraction(_dims(4, pp=4), 8) == 3 / 8 and bubble_fraction(_dims(4, pp=4, virtual_stages=2), 8) == 3 / 16
    )
    piped = predict_step_time(stages, _dims(4, pp=4), h100, microbatches=8)
    assert piped.compute == pytest.approx(3.0) and piped.bubble == pytest.approx(2.0 * 3 / 8)


def test_hops_of_each_kind_and_gradient_reductions_once_an_accumulated_step():
    h100 = profile_named("h100-80gb")
    assert [ring_steps(kind, 8) for kind in (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BROADCAST, POINT_TO_POINT)] == [
        14,
        7,
        7,
        7,
        1,
    ]
    rate, one = h100.flops_per_s * h100.efficiency, CollectiveCount(1, 10**6)
    tensor = Collective(ALL_REDUCE, TENSOR_PARALLEL, (0, 1))
    gather, reduce = Collective(ALL_GATHER, REPLICAS, (0, 2)), Collective(REDUCE_SCATTER, REPLICAS, (0, 2))
    h100 = replace(h100, overlap=0.0)  # every data-parallel collective waited on, to see each one's count
    step = _step(rate, {tensor: one, gather: one, reduce: one})
    single, accumulated = (predict_step_time([step], _dims(4, tp=2), h100, accumulation=a) for a in (1, 4))
    seconds = {c: collective_seconds(c, 1, 10**6, h100) for c in (tensor, gather, reduce)}
    assert single.compute == pytest.approx(1.0) and accumulated.compute == pytest.approx(4.0)
    # each micro-batch's tensor-parallel collectives and FSDP2's all-gathers; the gradients' reduce-scatter once
    assert accumulated.communication == pytest.approx(4 * seconds[tensor] + 4 * seconds[gather] + seconds[reduce])
    # under a pipeline, the stages' gradients are averaged after the schedule: waited on even where overlap would hide
    after = predict_step_time([_step(rate, {reduce: one})], _dims(4, pp=2), profile_named("h100-80gb"))
    assert after.hidden_communication == 0 and after.communication == pytest.approx(seconds[reduce])


def test_cpu_ranks_split_and_share_the_cores_and_gpus_do_not():
    assert CPU_HERE.thread_speed(1) == pytest.approx(1 + CPU_HERE.thread_efficiency)
    assert CPU_HERE.thread_speed(2) == CPU_HERE.thread_speed(4) == 1.0
    assert all(profile.thread_speed(8) == 1.0 for profile in GPU_PROFILES.values())
    cpu = replace(CPU_HERE, operation_s=0.0)
    one_thread = cpu.flops_per_s * cpu.efficiency
    # 4 ranks on 2 cores: each rank's second of work takes two; a pipeline's ranks idle in its bubble, leaving their
    # cores to the others, so the bubble costs nothing until the ranks' work no longer fills the cores
    spread = predict_step_time([_step(one_thread, {})], _dims(4, tp=4), cpu)
    assert spread.compute == pytest.approx(1.0) and spread.total == pytest.approx(2.0)
    piped = predict_step_time([_step(one_thread, {})], _dims(4, pp=4), cpu, microbatches=4)
    assert piped.bubble == pytest.approx(3 / 4) and piped.total == pytest.approx(2.0)
    drained = predict_step_time([_step(one_thread, {})], _dims(4, pp=4), cpu, microbatches=1)
    assert drained.total == pytest.approx(1.0 + 3.0) and drained.sharing == 0


def test_an_unknown_hardware_profile_is_one_line_listing_the_known_ones():
    with pytest.raises(ValueError, match=r"^hardware='tpu-v9' is not a known profile; use one of h100-80gb, "):
        profile_named("tpu-v9")
