"""Dropout masks in Megatron's manner, through Lightning at dp=2 x tp=2: inside attention (the local heads, a
sharded region) each tensor-parallel rank draws its own mask; in the residual stream (replicated) every rank of a
tensor-parallel group draws the same one; and data-parallel replicas draw different masks in both."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn

from tests.distributed import run_on_ranks
from tests.lightning_helpers import fit
from tests.test_parallelize import VOCAB

DIM, HEADS, P = 32, 4, 0.3
TP, WORLD = 2, 4  # ranks 0, 1 form one tensor-parallel group (data-parallel rank 0); ranks 2, 3 the other


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.head_dim = DIM // HEADS
        self.dropout = nn.Dropout(P)  # on the attention probabilities of this rank's heads

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (proj(x).view(B, T, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, local heads, T, T)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        probs = self.dropout(scores.masked_fill(~causal, float("-inf")).softmax(-1))
        return self.out((probs @ v).transpose(1, 2).reshape(B, T, -1))


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = _Attention()
        self.dropout = nn.Dropout(P)  # on the residual branch: the replicated region

    def forward(self, x):
        return x + self.dropout(self.attn(self.norm(x)))


class DropoutLM(nn.Module):
    tp_plan = {
        "blocks.*.attn": "attention",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.out": "rowwise",
        "head": "colwise_gather_output",
    }

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class MaskRecorder(L.Callback):
    """The masks (dropped elements) every dropout module draws at the first training step, by module name."""

    def __init__(self):
        self.masks: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer, pl_module):
        for name, module in pl_module.model.named_modules():
            if isinstance(module, nn.Dropout):
                module.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def record(module, inputs, output):
            self.masks.setdefault(name, output.detach().eq(0) & inputs[0].detach().ne(0))

        return record


def _masks(rank, world_size):
    recorder = MaskRecorder()
    fit(TP, 1, module_kwargs=dict(build=DropoutLM), callbacks=[recorder])
    gathered = {}
    for name, mask in sorted(recorder.masks.items()):
        masks = [torch.empty_like(mask) for _ in range(world_size)]
        dist.all_gather(masks, mask)
        gathered[name] = masks
    return gathered


def test_masks_differ_across_tp_in_attention_agree_in_the_residual_stream_and_differ_across_dp():
    gathered = run_on_ranks(_masks, WORLD, timeout=300)[0]
    attention = [name for name in gathered if ".attn." in name]
    residual = [name for name in gathered if name.endswith(".dropout") and ".attn." not in name]
    assert len(attention) == 2 and len(residual) == 2, list(gathered)
    for name in attention + residual:
        assert all(mask.any() for mask in gathered[name]), name  # dropout was active on every rank
    for name in attention:  # sharded region: each rank's local heads get their own mask
        masks = gathered[name]
        assert not torch.equal(masks[0], masks[1]) and not torch.equal(masks[2], masks[3]), name
    for name in residual:  # replicated region: the same mask on both ranks of a tensor-parallel group
        masks = gathered[name]
        assert torch.equal(masks[0], masks[1]) and torch.equal(masks[2], masks[3]), name
    for name in attention + residual:  # data-parallel replicas: different masks
        masks = gathered[name]
        assert not torch.equal(masks[0], masks[2]) and not torch.equal(masks[1], masks[3]), name
