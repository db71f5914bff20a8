"""Gradient clipping under tensor parallelism, checked against torch's own clipping on the unsharded model.

Through Lightning the reference is plain Lightning on one device (strategy="auto"), whose precision plugin clips
with `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_`: a clipping bug of ours cannot sit on both sides. After
clipping, the full gradients (shards gathered) must equal the reference's and respect the limit. The inf norm,
which Lightning's Trainer does not expose, is checked on `tp_train.parallel.clipping.clip_grad_norm_` directly.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.distributed as dist

import tp_train
from tests.distributed import run_on_ranks
from tests.lightning_helpers import SEQ_LEN, fit
from tests.parity import full_tensors, next_token_loss
from tests.test_parallelize import VOCAB, SwiGLUModel
from tp_train.parallel.clipping import clip_grad_norm_

STEPS = 5
LIMITS = {"norm": 0.5, "value": 0.01}  # both below what this model's gradients reach at init: clipping is active


class ClippedGradients(L.Callback):
    """Per step, just before the optimizer uses them (after clipping): the full gradients' L2 norm and largest
    element; at the first step, the full gradients themselves. Also, per step, the L2 norm before clipping."""

    def __init__(self, tensor_parallel: bool):
        self.tensor_parallel = tensor_parallel
        self.norms, self.max_elements, self.norms_before, self.first = [], [], [], None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms_before.append(torch.nn.utils.get_total_norm(self._full(trainer, pl_module).values()).item())

    def on_train_start(self, trainer, pl_module):
        clip = pl_module.configure_gradient_clipping  # Lightning's hook that clips, called right before the update

        def clip_then_record(*args, **kwargs):
            clip(*args, **kwargs)
            self._record(trainer, pl_module)

        pl_module.configure_gradient_clipping = clip_then_record

    def _record(self, trainer, pl_module):
        grads = self._full(trainer, pl_module)
        self.norms.append(torch.nn.utils.get_total_norm(grads.values()).item())
        self.max_elements.append(max(g.abs().max().item() for g in grads.values()))
        if self.first is None:
            self.first = {name: g.clone() for name, g in grads.items()}

    def _full(self, trainer, pl_module) -> dict[str, torch.Tensor]:
        if self.tensor_parallel:
            grads = full_tensors(pl_module.model, trainer.strategy.tensor_parallel_group, grads=True)
        else:
            grads = {name: p.grad for name, p in pl_module.model.named_parameters()}
        return {name: grad for name, grad in grads.items() if grad is not None}


def _train(rank, world_size, tp, algorithm):
    recorder = ClippedGradients(tensor_parallel=tp is not None)
    _, steps = fit(
        tp,
        STEPS,
        callbacks=[recorder],
        gradient_clip_val=LIMITS[algorithm],
        gradient_clip_algorithm=algorithm,
    )
    return steps.losses, recorder.norms, recorder.max_elements, recorder.norms_before, recorder.first


@pytest.fixture(scope="module")
def plain_lightning():
    """Plain Lightning on one device, per clipping algorithm."""
    return {algorithm: run_on_ranks(_train, 1, None, algorithm)[0] for algorithm in LIMITS}


@pytest.mark.parametrize(
    "algorithm,world_size,tp",
    [("norm", 2, 2), ("norm", 4, 2), ("value", 2, 2)],
    ids=["norm-tp2", "norm-dp2xtp2", "value-tp2"],
)
def test_clipping_equals_plain_lightning_and_respects_the_limit(algorithm, world_size, tp, plain_lightning):
    limit = LIMITS[algorithm]
    ref_losses, ref_norms, ref_max_elements, ref_norms_before, ref_first = plain_lightning[algorithm]
    # torch's clipping was active in the reference, and left the gradients at the limit.
    if algorithm == "norm":
        assert ref_norms_before[0] > 1.5 * limit and max(ref_norms) <= limit * (1 + 1e-6)
    else:
        assert ref_max_elements[0] == pytest.approx(limit)
    for rank, (losses, norms, max_elements, _, first) in enumerate(
        run_on_ranks(_train, world_size, tp, algorithm, timeout=300)
    ):
        if algorithm == "norm":
            assert max(norms) <= limit * (1 + 1e-5), f"rank {rank}: norm after clipping {norms} above {limit}"
        assert max(max_elements) <= (limit if algorithm == "value" else float("inf")) * (1 + 1e-6)
        worst = max((first[name] - ref_first[name]).abs().max().item() for name in ref_first)
        assert worst < 1e-6, f"rank {rank}: clipped gradients differ from torch's by {worst:.3g}"
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)


def _clip_directly(rank, world_size, norm_type, max_norm):
    """One backward on an unsharded model and on its sharded copy, then torch's clipping and ours."""
    torch.manual_seed(0)
    reference = SwiGLUModel()
    model = tp_train.parallelize(copy.deepcopy(reference))
    idx = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    next_token_loss(reference(idx), idx).backward()
    next_token_loss(model(idx), idx).backward()
    ref_total = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type=norm_type)
    sharded = {id(param) for _, param, _ in tp_train.named_sharded_parameters(model)}
    total = clip_grad_norm_(model.parameters(), max_norm, sharded, dist.group.WORLD, norm_type=norm_type)
    grads = full_tensors(model, dist.group.WORLD, grads=True)
    reference_grads = dict(reference.named_parameters())
    return {
        "total": (total.item(), ref_total.item()),
        "after": torch.nn.utils.get_total_norm(grads.values(), norm_type).item(),
        "worst": max((grads[name] - reference_grads[name].grad).abs().max().item() for name in grads),
    }


@pytest.mark.parametrize("norm_type,max_norm", [(float("inf"), 0.01), (2.0, 0.1)], ids=["inf", "l2"])
@pytest.mark.parametrize("tp", [2, 4])
def test_clip_grad_norm_equals_torch_on_the_unsharded_model(tp, norm_type, max_norm):  # tp=4: several shard norms
    for result in run_on_ranks(_clip_directly, tp, norm_type, max_norm, timeout=120):
        total, ref_total = result["total"]
        assert ref_total > 2 * max_norm  # clipping was active
        assert total == pytest.approx(ref_total, rel=1e-5)
        assert result["after"] <= max_norm * (1 + 1e-5)
        assert result["worst"] < 1e-7


def _large_gradient_norm(rank, world_size):
    """A whole 8M-element gradient (gpt-oss's experts at hf.yaml's sizes), sharded in two along dim 0, and the
    global norm against float64."""
    torch.manual_seed(0)
    full = torch.randn(128, 128, 512) * 1e-3 * (torch.rand(128, 1, 1) < 0.1)  # mostly idle experts
    shard = torch.nn.Parameter(full.chunk(world_size)[rank].clone())
    shard.grad = shard.detach().clone()
    norm = tp_train.global_grad_norm([shard], {id(shard)}, dist.group.WORLD).item()
    return norm, full.double().square().sum().sqrt().item()


@pytest.mark.slow
def test_the_global_norm_of_millions_of_elements_is_exact_to_float64_at_every_tp():
    """torch's one fp32 norm over 8M elements drifts 1.4e-5 relative on CPU, differently for a shard than for the
    whole tensor: gpt-oss's clipped steps at tp=2 and tp=1 ended 6.7e-4 apart in 4 steps (issue 41)."""
    for tp in (1, 2):
        for norm, exact in run_on_ranks(_large_gradient_norm, tp):
            assert abs(norm - exact) / exact < 1e-6, (tp, norm, exact)


def _float64_norm(rank, world_size):
    """One backward of a float64 model and of its sharded copy: the global norm against torch's on the whole model."""
    torch.manual_seed(0)
    reference = SwiGLUModel().double()
    model = tp_train.parallelize(copy.deepcopy(reference))
    idx = torch.randint(0, VOCAB, (2, SEQ_LEN), generator=torch.Generator().manual_seed(3))
    next_token_loss(reference(idx), idx).backward()
    next_token_loss(model(idx), idx).backward()
    exact = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])
    sharded = {id(param) for _, param, _ in tp_train.named_sharded_parameters(model)}
    norm = tp_train.global_grad_norm(list(model.parameters()), sharded, dist.group.WORLD)
    return norm.dtype, abs(norm.item() - exact.item()) / exact.item()


def test_the_global_norm_of_a_float64_model_is_float64():
    """precision=64: the norm is not rounded to float32 on the way (which would leave it 1e-8 off)."""
    for dtype, error in run_on_ranks(_float64_norm, 2):
        assert dtype == torch.float64 and error < 1e-13, (dtype, error)
