"""BatchNorm between a column and a row layer (LeViT's, after every projection) normalises each channel on its own,
in training and in eval mode: with no plan given, the auto-planner splits it with the column it follows (weight,
bias, running_mean and running_var, by the column's sections), splits a (heads, positions) attention bias by its
first dim, and the model matches the unsharded one in training at tp 2 and 4. The probe sees such a bias through an
eval-mode cache of it (a dict of tensors, LeViT's `attention_bias_cache`), and running statistics that fit the probe
batch (`tp_train.plan.deciding.autoplan`), left as they were after."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import VOCAB_OF_TESTS as VOCAB
from tests.parity import assert_parity, parity_of_each
from tests.test_parallelize import ATOL
from tp_train.plan.deciding.autoplan import probe_statistics
from tp_train.plan.probe_input import ProbeInput

WIDTH, HEADS, KEY, TOKENS = 32, 4, 8, 16


class LinearBN(nn.Module):
    """A Linear without bias, then a BatchNorm over its outputs (LeViT's `MLPLayerWithBN`)."""

    def __init__(self, fan_in: int, fan_out: int):
        super().__init__()
        self.linear, self.batch_norm = nn.Linear(fan_in, fan_out, bias=False), nn.BatchNorm1d(fan_out)

    def forward(self, x):
        return self.batch_norm(self.linear(x).flatten(0, 1)).reshape(*x.shape[:2], -1)


class BNAttention(nn.Module):
    """Per head [q; k; v] from one projection and its BatchNorm, and a learnt bias per head and key position, which
    eval mode caches (LeViT's `attention_biases` and `attention_bias_cache`)."""

    def __init__(self):
        super().__init__()
        self.num_heads = HEADS
        self.qkv = LinearBN(WIDTH, HEADS * 3 * KEY)
        self.proj = LinearBN(HEADS * KEY, WIDTH)
        self.attention_biases = nn.Parameter(torch.randn(HEADS, TOKENS) * 0.5)
        self.bias_cache = {}

    def biases(self):
        if self.training:
            return self.attention_biases[:, None, :]
        if "bias" not in self.bias_cache:
            self.bias_cache["bias"] = self.attention_biases[:, None, :]
        return self.bias_cache["bias"]

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, self.num_heads, 3 * KEY).transpose(1, 2).split(KEY, dim=-1)
        scores = q @ k.transpose(-1, -2) * KEY**-0.5 + self.biases()[..., :T]
        return self.proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, self.num_heads * KEY))


class BNBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = BNAttention()
        self.mlp = nn.Sequential(LinearBN(WIDTH, 2 * WIDTH), nn.Hardswish(), LinearBN(2 * WIDTH, WIDTH))

    def forward(self, x):
        x = x + self.attention(x)
        return x + self.mlp(x)


class BNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(BNBlock() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


SPLIT_WITH_THE_HEADS = [
    "blocks.*.attention.qkv.batch_norm.weight",
    "blocks.*.attention.qkv.batch_norm.bias",
    "blocks.*.attention.qkv.batch_norm.running_mean",
    "blocks.*.attention.qkv.batch_norm.running_var",
    "blocks.*.attention.attention_biases",
]


@pytest.mark.parametrize("tp", [2, 4])
def test_the_auto_planner_splits_batch_norms_and_per_head_biases_with_the_heads(tp):
    torch.manual_seed(0)
    plan = tp_train.infer_plan(BNModel(), tensor_parallel_size=tp)
    assert all(plan[name] == "colwise" for name in SPLIT_WITH_THE_HEADS), plan
    assert plan["blocks.*.attention.qkv.linear"] == "colwise" and plan["blocks.*.attention.proj.linear"] == "rowwise"
    assert plan["blocks.0.mlp.0.batch_norm"] == "channelwise" and plan["blocks.*.attention"].startswith("attention")
    assert not plan.notes


def test_probe_statistics_hold_the_probe_batch_and_leave_the_norm_as_it_was():
    norm = nn.BatchNorm1d(3).eval()
    x = torch.randn(64, 3) * 5 + 2
    with probe_statistics(norm, ProbeInput((x,), {})):
        assert torch.allclose(norm.running_mean, x.mean(0)) and not norm.training
        assert torch.allclose(norm(x).std(0), torch.ones(3), atol=0.05)  # normalised by the probe's statistics
    assert torch.equal(norm.running_mean, torch.zeros(3)) and norm.momentum == 0.1 and not norm.training


def _parity(rank, world_size):
    return parity_of_each({"batch_norm_attention": (BNModel, lambda model, idx: model(idx))})


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_batch_norm_attention_matches_unsharded_in_training(tp):
    for rank, results in enumerate(run_on_ranks(_parity, tp, timeout=600)):
        assert_parity(results["batch_norm_attention"], tp, rank, ATOL)
