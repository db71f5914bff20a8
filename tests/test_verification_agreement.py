"""Verification that fails on one rank only ends on every rank with that rank's one-line error, within seconds,
wherever it fails (the swap check, the region check, the whole model's forward, outputs or gradients); and planning
on the group's first rank leaves every rank's random generators and modules as they would be had each planned.

Each fault below acts on the last rank only, and only in the phase it is named for. Without the agreement
(`tp_train.parallel.agreement`) the other ranks wait in a collective the failing rank never joins, and these tests
time out."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import tp_train
from tests.distributed import run_on_ranks
from tp_train.errors import PlanVerificationError

VOCAB, WIDTH, HIDDEN = 32, 16, 32
# The modules armed to fail on the rank that arms them; the unsharded copy verification makes is not among them.
ARMED: set[int] = set()


class _FaultyLinear(nn.Linear):
    """Fails in the swap check: the check runs the replaced module on a one-sequence batch with gradients on."""

    def forward(self, x):
        if id(self) in ARMED and torch.is_grad_enabled() and x.shape[0] == 1:
            raise RuntimeError("the up projection fails on this rank")
        return super().forward(x)


class _Inner(nn.Module):
    """An MLP on its own weights, planned as an 'all_reduce' region; fails once sharded (the region check)."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(HIDDEN, WIDTH) / WIDTH**0.5)
        self.w_out = nn.Parameter(torch.randn(WIDTH, HIDDEN) / HIDDEN**0.5)

    def forward(self, x):
        if id(self) in ARMED and self.w_in.shape[0] < HIDDEN:
            raise RuntimeError("the region fails on this rank")
        return torch.tanh(x @ self.w_in.t()) @ self.w_out.t()


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, factor):
        ctx.save_for_backward(x, scale)
        ctx.factor = factor
        return x * scale

    @staticmethod
    def backward(ctx, grad):
        x, scale = ctx.saved_tensors
        return grad * scale, (grad * x).sum().reshape(1) * ctx.factor, None


class _Fault(nn.Module):
    """In the whole-model check only (a batch of 2 with gradients on): `raise` stops the forward there, `shift` moves
    the output, `gradient` doubles the gradient of its own replicated scale (its input's gradient stays right)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.kind = None

    def forward(self, x):
        armed = id(self) in ARMED and torch.is_grad_enabled() and x.shape[0] == 2
        if armed and self.kind == "raise":
            raise RuntimeError("the forward fails on this rank")
        x = _ScaleGradient.apply(x, self.scale, 2.0 if armed and self.kind == "gradient" else 1.0)
        return x + 1.0 if armed and self.kind == "shift" else x


class _FaultyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up, self.down = _FaultyLinear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.inner = _Inner()
        self.fault = _Fault()  # between the MLP's all-reduce and the head's all-gather
        self.head = nn.Linear(WIDTH, VOCAB)
        self.last = _Fault()  # on the whole logits: what it changes, only its rank sees

    def forward(self, idx):
        x = self.embed(idx)
        x = x + self.down(torch.relu(self.up(x)))
        x = x + self.inner(x)
        return self.last(self.head(self.fault(x)))


PLAN = {
    "up": "colwise",
    "down": "rowwise",
    "inner": "all_reduce",
    "inner.w_in": "colwise",
    "inner.w_out": "rowwise",
    "head": "colwise_gather_output",
}
# Where verification fails, and what its one line then says.
FAULTS = {
    "swap check": ("up", None, "module 'up' (_FaultyLinear) sharded as ColumnParallelLinear[_FaultyLinear] fails"),
    "region check": ("inner", None, "module 'inner' (_Inner) planned 'all_reduce'"),
    "whole-model forward": ("fault", "raise", "the sharded model fails on a probe batch in the forward of 'fault'"),
    "whole-model outputs": ("last", "shift", "the sharded model's output differs"),
    "whole-model gradients": ("last", "gradient", "the gradient of 'last.scale' differs"),
}


def _one_rank_fails(rank, world_size, place):
    name, kind, _ = FAULTS[place]
    torch.manual_seed(0)
    model = _FaultyLM()
    model.get_submodule(name).kind = kind
    # A pooled rank keeps this module's set across tests: an id armed by an earlier test may be a new module's now.
    ARMED.clear()
    if rank == world_size - 1:
        ARMED.add(id(model.get_submodule(name)))
    start = time.monotonic()
    try:
        tp_train.parallelize(model, plan=PLAN, verify=True)
        refusal = None
    except PlanVerificationError as error:
        refusal = str(error)
    seconds = time.monotonic() - start
    dist.barrier()  # each rank lives on after its error, as a training process does, until every rank is here
    return refusal, seconds


@pytest.mark.parametrize("place", FAULTS)
def test_verification_failing_on_one_rank_ends_on_every_rank_with_its_error(place):
    results = run_on_ranks(_one_rank_fails, 2, place, timeout=60)
    (first, _), (second, _) = results
    assert first is not None and first == second, results
    assert first.startswith("tensor-parallel plan verification failed (rank 1): ") and "\n" not in first, first
    assert FAULTS[place][2] in first, first
    assert max(seconds for _, seconds in results) < 20, results


def test_a_failure_on_one_of_four_ranks_ends_every_rank():
    for refusal, _ in run_on_ranks(_one_rank_fails, 4, "whole-model forward", timeout=90):
        assert refusal is not None and "(rank 3)" in refusal and FAULTS["whole-model forward"][2] in refusal


class _DrawsWhileItRuns(nn.Module):
    """A model whose forward draws from every global generator (NumPy's as BigBird's random blocks, Python's, and
    torch's) and, below a length, swaps one of its modules for another class, as BigBird's attention does."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, HIDDEN), nn.Linear(HIDDEN, WIDTH)
        self.act = nn.ReLU()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        noise = np.random.rand() + random.random() + float(torch.rand(()))
        if idx.shape[1] < 64 and isinstance(self.act, nn.ReLU):
            self.act = nn.GELU()
        x = self.embed(idx)
        return self.head(x + self.down(self.act(self.up(x)))) + 0.0 * noise


def _generators(model: nn.Module) -> tuple:
    numpy_state = np.random.get_state()
    torch_state = torch.get_rng_state().tolist()
    return torch_state, (numpy_state[1].tolist(), numpy_state[2]), random.getstate(), type(model.act).__name__


def _generators_around_planning(rank, world_size):
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = _DrawsWhileItRuns()
    before = _generators(model)
    tp_train.parallelize(model, verify=False)  # the plan inferred on rank 0 only
    return before, _generators(model)


def test_planning_on_the_first_rank_leaves_every_ranks_generators_and_modules_alike():
    """Rank 0 plans (its probes draw and swap a module); then every rank's generators and modules are the same as
    before planning: rank 0 is as if it had not probed, and so are the others."""
    results = run_on_ranks(_generators_around_planning, 2, timeout=60)
    assert results[0][0] == results[1][0]  # the ranks start alike
    for rank, (before, after) in enumerate(results):
        for generator, found, expected in zip(("torch", "numpy", "python", "module"), after, before, strict=True):
            assert found == expected, f"rank {rank}: {generator} differs after planning"


def _bigbird(rank, world_size):
    import transformers

    torch.manual_seed(0)
    config = transformers.BigBirdConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                        intermediate_size=128, vocab_size=96, max_position_embeddings=64)  # fmt: skip
    model = transformers.BigBirdForCausalLM(config)
    start = time.monotonic()
    try:
        tp_train.parallelize(model)
        return "sharded", time.monotonic() - start
    except PlanVerificationError as error:
        return str(error), time.monotonic() - start


def test_bigbird_with_its_block_sparse_default_is_refused_in_one_line_on_both_ranks():
    """The issue's BigBird hung at tp=2: rank 0's planner probe made it swap its attention for full attention on
    rank 0 only. Now planning leaves the model as it was, and the verification forward's swap is refused."""
    (first, first_seconds), (second, _) = run_on_ranks(_bigbird, 2, timeout=60)
    assert first == second and "\n" not in first, (first, second)
    assert "replaced its module 'bert.encoder.layer.0.attention.self' (BigBirdBlockSparseAttention)" in first, first
    assert first_seconds < 30
