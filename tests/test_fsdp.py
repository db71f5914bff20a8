"""Sharded data parallelism (`TensorParallelStrategy(data_parallel="fsdp")`, torch's FSDP2 over the data-parallel
axis) at dp2 x tp2 on gloo ranks, and gradient accumulation under dp x tp in both modes: the losses of plain
Lightning on one device with the same global batch, a quarter of the model state per rank, and no data-parallel
reduction on the micro-batches before the last."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from models.gpt import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit, fit_plain, meta_built
from tests.test_parallelize import SwiGLUModel
from tp_train import NonFiniteGuard, TensorParallelMixedPrecision
from tp_train.parallel.mesh import DATA_PARALLEL, TENSOR_PARALLEL
from tp_train.parallel.sharding import local_part, named_sharded_parameters, unshard_tensor
from tp_train.plan.parallelize import parallelize
from tp_train.tools.memory import ADAMW_STATES, parameters_per_rank
from tp_train.training.data_parallel import fully_shard_data_parallel

STEPS = 10
CLIP = 0.5  # below the gradient norm at init, so clipping is active
CLIPPING = dict(gradient_clip_val=CLIP, gradient_clip_algorithm="norm")


class _GradientSync(L.Callback):
    """After each micro-batch's backward: does this rank hold (sharded) gradients, and are they the same on its
    data-parallel peers (a sum over this rank's gradient elements, compared across the dp group)?"""

    def __init__(self):
        self.seen: list[tuple[bool, bool]] = []

    def on_after_backward(self, trainer, pl_module):
        grads = [local_part(p.grad) for p in pl_module.parameters() if p.grad is not None]
        total = torch.stack([g.double().sum() for g in grads]).sum() if grads else torch.zeros((), dtype=torch.double)
        peers = [torch.zeros_like(total) for _ in range(trainer.strategy.data_parallel_size)]
        dist.all_gather(peers, total, group=trainer.strategy.data_parallel_group)
        self.seen.append((bool(grads), all(torch.equal(peers[0], peer) for peer in peers)))


def _train(rank, world_size, data_parallel, accumulate, build_on_meta=False, strategy_kwargs=None):
    sync = _GradientSync()
    trainer, recorder = fit(
        2,
        STEPS,
        module_kwargs=dict(build_in_configure_model=build_on_meta),
        data_parallel=data_parallel,
        accumulate_grad_batches=accumulate,
        callbacks=[sync],
        strategy_kwargs=strategy_kwargs,
        **CLIPPING,
    )
    losses = recorder.losses  # per micro-batch, each already divided by `accumulate` by Lightning
    step_losses = [sum(losses[i : i + accumulate]) for i in range(0, len(losses), accumulate)]
    module = trainer.lightning_module
    (optimizer,) = trainer.optimizers
    state = sum(local_part(p).numel() for p in module.parameters())
    state += sum(local_part(v).numel() for s in optimizer.state.values() for k, v in s.items() if k != "step")
    return step_losses, recorder.clip_norms[accumulate - 1 :: accumulate], sync.seen, state  # clipped at the last


@pytest.fixture(scope="module")
def plain_lightning():
    recorder = run_on_ranks(_plain, 1)[0]
    return recorder


def _plain(rank, world_size):
    recorder = fit_plain(STEPS, **CLIPPING)
    return recorder.losses, recorder.local_norms


def test_fsdp_dp2_tp2_trains_like_plain_lightning_with_a_quarter_of_the_state(plain_lightning):
    ref_losses, ref_norms = plain_lightning
    assert len(ref_losses) == STEPS and ref_norms[0] > CLIP
    results = run_on_ranks(_train, 4, "fsdp", 1, timeout=300)
    for losses, clip_norms, _, _ in results:
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)  # each element counted once over dp and tp
    whole = sum(p.numel() for p in SwiGLUModel().parameters()) * (1 + ADAMW_STATES)
    measured = max(state for *_, state in results)
    predicted = parameters_per_rank(SwiGLUModel(), tp=2, dp=2, data_parallel="fsdp") * (1 + ADAMW_STATES)
    print(f"fsdp dp2 x tp2: {measured} of {whole} state elements per rank, predicted {predicted}")
    assert measured / whole <= 0.27
    assert predicted == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp"])
def test_accumulating_two_micro_batches_is_one_big_batch(data_parallel, plain_lightning):
    ref_losses, ref_norms = plain_lightning
    for losses, clip_norms, seen, _ in run_on_ranks(_train, 4, data_parallel, 2, timeout=300):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)
        first, last = seen[0::2], seen[1::2]
        if data_parallel == "ddp":  # no_sync: each rank keeps its own micro-batch's gradients until the last
            assert first == [(True, False)] * STEPS and last == [(True, True)] * STEPS
        else:  # FSDP2 without gradient sync holds unsharded gradients, and reduce-scatters after the last
            assert first == [(False, True)] * STEPS and all(present for present, _ in last)


def _plain_from_meta(rank, world_size):
    recorder = fit_plain(STEPS, module_kwargs=dict(build=meta_built(SwiGLUModel)), **CLIPPING)
    return recorder.losses, recorder.local_norms


def test_fsdp_with_activation_checkpointing_and_a_model_built_on_meta():
    # plain Lightning from the weights a meta build starts from (drawn per parameter name, not in an eager build's
    # order: tests/test_initial_weights.py checks them)
    ref_losses, ref_norms = run_on_ranks(_plain_from_meta, 1)[0]
    features = dict(activation_checkpointing=True)
    for losses, clip_norms, _, _ in run_on_ranks(_train, 4, "fsdp", 1, True, features, timeout=300):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert clip_norms == pytest.approx(ref_norms, rel=1e-5)


class _InjectNonFinite(L.Callback):
    """On one rank only, at one step, make one of its gradient pieces infinite after backward."""

    def __init__(self, rank: int, step: int):
        self.rank, self.step = rank, step

    def on_after_backward(self, trainer, pl_module):
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            local_part(grad).fill_(float("inf"))


def _precision(rank, world_size, precision):
    callbacks = [_InjectNonFinite(rank=1, step=3)]
    plugins = []
    if precision == "16-mixed":  # fp16 on CPU: the loss scaler skips the step
        plugins, precision = [TensorParallelMixedPrecision("16-mixed", "cpu")], None
    else:  # no scaler: the guard skips it
        callbacks.append(NonFiniteGuard("skip"))
    trainer, recorder = fit(
        2, STEPS, module_kwargs=dict(lr=3e-3), data_parallel="fsdp", callbacks=callbacks, plugins=plugins,
        precision=precision,
    )  # fmt: skip
    dtypes = {str(p.dtype) for p in trainer.lightning_module.parameters()}
    return recorder.losses, recorder.skipped, recorder.scales, dtypes


@pytest.mark.parametrize(
    "precision,dtype", [("16-mixed", "torch.float32"), ("bf16-mixed", "torch.float32"), ("bf16-true", "torch.bfloat16")]
)
def test_fsdp_precisions_train_and_skip_a_non_finite_step_on_every_rank(precision, dtype):
    results = run_on_ranks(_precision, 4, precision, timeout=300)
    for losses, skipped, scales, dtypes in results:
        assert dtypes == {dtype}
        assert skipped == [False, False, False, True] + [False] * (STEPS - 4)  # on every rank alike
        assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], losses
        if precision == "16-mixed":
            assert scales[3] == scales[2] / 2


def _gpt_gradients(rank, world_size):
    """One step of a GPT at dp2 x tp2 under FSDP2 with sequence parallelism and activation checkpointing, each dp
    rank on half of the batch: the loss and every gradient, assembled whole, against the unsharded GPT's."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(DATA_PARALLEL, TENSOR_PARALLEL))
    torch.manual_seed(0)
    reference = GPT(GPTConfig(vocab_size=67, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0))
    model = copy.deepcopy(reference)
    idx = torch.randint(0, 67, (4, 17), generator=torch.Generator().manual_seed(1))
    _, loss = reference(idx[:, :-1], idx[:, 1:])
    loss.backward()
    parallelize(model, mesh[TENSOR_PARALLEL], sequence_parallel=True, activation_checkpointing=True, verify=False)
    fully_shard_data_parallel(model, [model], mesh[DATA_PARALLEL])
    half = idx.chunk(2)[mesh[DATA_PARALLEL].get_local_rank()]
    _, sharded_loss = model(half[:, :-1], half[:, 1:])
    sharded_loss.backward()
    mean_loss = sharded_loss.detach().clone()
    dist.all_reduce(mean_loss)
    specs = {name: spec for name, _, spec in named_sharded_parameters(model)}
    errors = {}
    for name, param in model.named_parameters():
        grad = param.grad.full_tensor()  # this tensor-parallel rank's gradient, gathered over dp
        if name in specs:
            grad = unshard_tensor(grad, specs[name], mesh[TENSOR_PARALLEL].get_group())
        expected = reference.get_parameter(name).grad
        # Relative to the gradient's size, or to 1e-2 for one near zero (a key bias: softmax ignores it).
        errors[name] = ((grad - expected).abs().max() / max(expected.abs().max().item(), 1e-2)).item()
    return (mean_loss.item() / world_size - loss.item()), errors


def test_fsdp_with_sequence_parallelism_and_checkpointing_gives_the_unsharded_gradients():
    for loss_error, errors in run_on_ranks(_gpt_gradients, 4, timeout=300):
        assert abs(loss_error) < 1e-5
        assert len(errors) > 10 and max(errors.values()) < 1e-5, errors
