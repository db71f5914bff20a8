"""Attention written the way real projects write it (our own code, in each project's manner), for the auto-planner
and local-view tests: head counts in a config object shared by the whole model (litgpt), a fused grouped-query
projection with unequal [q; k; v] sections or interleaved per group (litgpt), head counts in einops-style
`Rearrange` layers built once (x-transformers), head size taken from the input's width (nanoGPT), and an attention
whose head count is a literal in its code (nothing can localise it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.parity import VOCAB_OF_TESTS as VOCAB


class _LM(nn.Module):
    """Token embedding, pre-norm blocks of `attention` and an MLP, final norm, head."""

    def __init__(self, make_attention, dim: int, n_layers: int = 2, vocab: int = VOCAB):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(_Block(make_attention(), dim) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _Block(nn.Module):
    def __init__(self, attention: nn.Module, dim: int):
        super().__init__()
        self.norm_1, self.attn, self.norm_2 = nn.LayerNorm(dim), attention, nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


# ---------------------------------------------------------------------------------- litgpt: a shared Config


@dataclass
class Config:
    n_embd: int = 64  # model width
    n_head: int = 8  # query heads
    n_query_groups: int = 4  # key/value heads (grouped-query attention)
    head_size: int = 8  # width of one head
    interleaved: bool = False  # qkv laid out per group [q_g..., k_g, v_g] instead of [q; k; v]


class ConfigAttention(nn.Module):
    """Reads every count from `self.config`, the one Config object the whole model shares."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        width = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, width)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd)

    def forward(self, x):
        B, T, _ = x.shape
        cfg = self.config
        qkv = self.attn(x)
        q_per_kv = cfg.n_head // cfg.n_query_groups
        if cfg.interleaved:
            qkv = qkv.view(B, T, cfg.n_query_groups, q_per_kv + 2, cfg.head_size)  # (B, T, groups, q.. k v, hs)
            q, k, v = qkv.split((q_per_kv, 1, 1), dim=3)
            q = q.reshape(B, T, cfg.n_head, cfg.head_size)
            k, v = (t.reshape(B, T, cfg.n_query_groups, cfg.head_size) for t in (k, v))
        else:
            sizes = (cfg.n_head * cfg.head_size, cfg.n_query_groups * cfg.head_size, cfg.n_query_groups * cfg.head_size)
            q, k, v = qkv.split(sizes, dim=-1)
            q = q.view(B, T, cfg.n_head, cfg.head_size)
            k, v = (t.view(B, T, cfg.n_query_groups, cfg.head_size) for t in (k, v))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, hs)
        k, v = (t.repeat_interleave(q_per_kv, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, cfg.n_head * cfg.head_size))


def litgpt_style(interleaved: bool = False) -> nn.Module:
    config = Config(interleaved=interleaved)
    return _LM(lambda: ConfigAttention(config), config.n_embd)


# ------------------------------------------------------------------ x-transformers: einops-style Rearrange


def rearrange(tensor: torch.Tensor, pattern: str, **lengths: int) -> torch.Tensor:
    """The two head patterns of einops' `rearrange` attention code uses (our own implementation)."""
    if pattern == "b n (h d) -> b h n d":
        return tensor.unflatten(-1, (lengths["h"], -1)).transpose(1, 2)
    if pattern == "b h n d -> b n (h d)":
        return tensor.transpose(1, 2).flatten(-2)
    raise ValueError(f"pattern {pattern!r} is not one this test implements")


class Rearrange(nn.Module):
    """einops' layer: built from a pattern and axis lengths, which it checks and fixes once, when built."""

    def __init__(self, pattern: str, **axes_lengths: int):
        super().__init__()
        self.pattern, self.axes_lengths = pattern, axes_lengths
        self._recipe = (pattern, dict(axes_lengths))  # parsed once: changing axes_lengths later changes nothing

    def forward(self, x):
        pattern, lengths = self._recipe
        return rearrange(x, pattern, **lengths)


class EinopsAttention(nn.Module):
    def __init__(self, dim: int = 32, heads: int = 4, dim_head: int = 8):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, inner, bias=False) for _ in range(3))
        self.split_q_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x):
        q = self.split_q_heads(self.to_q(x))
        k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (self.to_k(x), self.to_v(x)))
        return self.to_out(self.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))


def einops_style() -> nn.Module:
    return _LM(EinopsAttention, 32)


def real_einops_style() -> nn.Module:
    """The same attention on the real einops, where it is installed."""
    from einops import rearrange as einops_rearrange
    from einops.layers.torch import Rearrange as EinopsRearrange

    class RealEinopsAttention(EinopsAttention):
        def __init__(self):
            super().__init__()
            self.split_q_heads = EinopsRearrange("b n (h d) -> b h n d", h=self.heads)
            self.merge_heads = EinopsRearrange("b h n d -> b n (h d)")

        def forward(self, x):
            q = self.split_q_heads(self.to_q(x))
            k, v = (einops_rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in (self.to_k(x), self.to_v(x)))
            return self.to_out(self.merge_heads(F.scaled_dot_product_attention(q, k, v, is_causal=True)))

    return _LM(RealEinopsAttention, 32)


# --------------------------------------------------------------------------- nanoGPT: widths from the input


class WidthAttention(nn.Module):
    def __init__(self, n_embd: int = 32, n_head: int = 4):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.resid_dropout = nn.Dropout(0.0)

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence, embedding width
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def nanogpt_style() -> nn.Module:
    return _LM(WidthAttention, 32)


# ----------------------------------------------------------------------- a literal head count: cannot be local


class LiteralHeadsAttention(nn.Module):
    """4 heads of 8, written into the code: no view of any attribute makes it run on fewer heads."""

    def __init__(self, dim: int = 32):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (p(x).view(B, T, 4, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, 32))


def literal_heads() -> nn.Module:
    return _LM(LiteralHeadsAttention, 32)


# ------------------------------------------------ Swin's shifted windows: a mask, and a head count, every second block


class MaskedHeadsAttention(nn.Module):
    """Views heads with -1, except when given a mask (every second block), which it adds per head, viewing the
    scores with its own head count (Donut-Swin's shifted windows)."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.masked_heads = heads  # read only when a mask is given
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x, mask=None):
        B, T, C = x.shape
        q, k, v = (p(x).view(B, T, -1, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(-1, -2) / 8**0.5
        if mask is not None:
            scores = scores.reshape(B * self.masked_heads, T, T) + mask
        y = scores.view(B, -1, T, T).softmax(-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class _MaskedBlock(_Block):
    def __init__(self, dim: int, masked: bool):
        super().__init__(MaskedHeadsAttention(dim), dim)
        self.masked = masked

    def forward(self, x):
        T = x.shape[1]
        mask = torch.full((T, T), float("-inf")).triu(1) if self.masked else None
        x = x + self.attn(self.norm_1(x), mask)
        return x + self.mlp(self.norm_2(x))


def masked_every_second_block() -> nn.Module:
    model = _LM(MaskedHeadsAttention, 32)
    model.h = nn.ModuleList(_MaskedBlock(32, masked=index % 2 == 1) for index in range(2))
    return model
