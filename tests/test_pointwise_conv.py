"""A 1x1 Conv2d split like a Linear over its channels (dim 1 of an (N, C, H, W) input): `colwise` then `rowwise`
in a plan give a convolutional MLP (SwiftFormer's, PoolFormer's) one all-reduce forward, and the same function."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import batch_parity_errors

ATOL = 1e-5


class _ConvMlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.mix = nn.Conv2d(dim, dim, kernel_size=3, padding=1, groups=dim)  # replicated: before the pair
        self.fc1 = nn.Conv2d(dim, hidden, kernel_size=1)
        self.fc2 = nn.Conv2d(hidden, dim, kernel_size=1)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.mix(x))))


class PointwiseConvModel(nn.Module):
    tp_plan = {"blocks.*.fc1": "colwise", "blocks.*.fc2": "rowwise"}

    def __init__(self, dim: int = 8, hidden: int = 16, classes: int = 5):
        super().__init__()
        self.stem = nn.Conv2d(3, dim, kernel_size=2, stride=2)
        self.blocks = nn.ModuleList(_ConvMlpBlock(dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, classes)

    def forward(self, pixels):
        x = self.stem(pixels)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def _parity(rank, world_size):
    torch.manual_seed(0)
    model = PointwiseConvModel()
    generator = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(3):
        pixels, labels = torch.randn(2, 3, 8, 6, generator=generator), torch.randint(0, 5, (2,), generator=generator)
        steps.append((pixels, lambda m, x: m(x), lambda out, labels=labels: F.cross_entropy(out, labels)))
    example = dict(example_input=torch.randn(2, 3, 8, 6, generator=generator))  # the whole-model check's input
    errors = batch_parity_errors(model, steps, example)
    sharded = tp_train.parallelize(PointwiseConvModel(), **example)
    kinds = {name: type(module).__name__ for name, module in sharded.named_modules() if name.endswith(("fc1", "fc2"))}
    shapes = {name: tuple(param.shape) for name, param in sharded.named_parameters() if ".fc" in name}
    return errors, kinds, shapes


@pytest.mark.parametrize("tp", [2, 4])
def test_pointwise_conv_pair_matches_unsharded(tp):
    for errors, kinds, shapes in run_on_ranks(_parity, tp, timeout=180):
        worst = {k: v for k, v in errors.items() if k.startswith(("logits", "grad:", "loss", "param:"))}
        assert max(worst.values()) < ATOL, sorted(worst.items(), key=lambda item: -item[1])[:3]
        assert kinds["blocks.0.fc1"] == "ColumnParallelPointwiseConv", kinds
        assert kinds["blocks.0.fc2"] == "RowParallelPointwiseConv", kinds
        assert shapes["blocks.0.fc1.weight"] == (16 // tp, 8, 1, 1) and shapes["blocks.0.fc1.bias"] == (16 // tp,)
        assert shapes["blocks.0.fc2.weight"] == (8, 16 // tp, 1, 1) and shapes["blocks.0.fc2.bias"] == (8,)


def _refusal(rank, world_size):
    try:
        tp_train.parallelize(PointwiseConvModel(), plan={"blocks.*.mix": "colwise", "blocks.*.fc2": "rowwise"})
    except ValueError as error:
        return str(error)
    return None


def test_a_grouped_conv_is_refused():
    for message in run_on_ranks(_refusal, 2, timeout=120):
        assert message and "blocks.0.mix" in message and "1x1 Conv2d" in message, message
