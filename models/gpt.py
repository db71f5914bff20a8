"""A small GPT in plain single-device PyTorch (after nanoGPT).

Nothing here knows about parallelism. The one concession to tensor parallelism is that attention infers its
head count from the projection width (`view(B, T, -1, head_dim)`), so the same forward runs on all heads or on
a rank's local heads; the sharding plan itself is data, `GPT.tp_plan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # tokenizer vocabulary (GPT-2's 50257 padded up to a multiple of 64)
    block_size: int = 1024  # longest sequence the position embedding covers
    n_layer: int = 12  # transformer blocks
    n_head: int = 12  # attention heads per block
    n_embd: int = 768  # residual stream width; a multiple of n_head
    dropout: float = 0.0  # dropout on embeddings, attention probabilities and residual branches
    bias: bool = True  # biases in Linear layers and LayerNorms


class KVCache:
    """The keys and values of the tokens seen so far, for generation: each attention appends its new tokens' (B,
    heads, T, head_dim) and attends over all of them. It holds the heads the attention computes, whichever they are."""

    def __init__(self) -> None:
        self.keys: dict[nn.Module, torch.Tensor] = {}
        self.values: dict[nn.Module, torch.Tensor] = {}

    def __len__(self) -> int:
        """Tokens held (by the first attention, before a forward adds the new ones to each in turn)."""
        return self.held(next(iter(self.keys))) if self.keys else 0

    def held(self, attention: nn.Module) -> int:
        """Tokens `attention`'s keys and values hold."""
        return self.keys[attention].shape[2] if attention in self.keys else 0

    def update(self, attention: nn.Module, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if attention in self.keys:
            k, v = torch.cat([self.keys[attention], k], dim=2), torch.cat([self.values[attention], v], dim=2)
        self.keys[attention], self.values[attention] = k, v
        return k, v


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd={config.n_embd} must be a multiple of n_head={config.n_head}")
        self.head_dim = config.n_embd // config.n_head
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj.residual_projection = True  # initialised smaller (see GPT._init_weights)
        self.dropout = config.dropout
        # The attention kernel: any function with SDPA's signature (a seam to swap the kernel, e.g. for one that
        # also masks across packed documents); the model itself never changes it.
        self.sdpa = F.scaled_dot_product_attention

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        # Heads come from the projection width, so the forward also runs on a subset of heads.
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, n_head, T, head_dim)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        past = 0 if cache is None else cache.held(self)
        mask = None
        if cache is not None:
            k, v = cache.update(self, k, v)  # (B, n_head, past + T, head_dim)
            if past and T > 1:  # new tokens see every cached one and the new ones before them
                mask = torch.ones(T, past + T, dtype=torch.bool, device=x.device).tril(diagonal=past)
        causal = mask is None and past == 0
        y = self.sdpa(q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0, is_causal=causal)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, n_head * head_dim)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.proj.residual_projection = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_1(x)) if cache is None else self.attn(self.ln_1(x), cache))
        return x + self.dropout(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    # Megatron's column-then-row split of each block, as data: q/k/v and fc are split by output features (heads),
    # proj by input features, so each block needs one all-reduce forward and one backward per sub-block.
    # The tied embedding/head pair is split along the vocabulary.
    tp_plan = {
        "tok_emb": "embedding_rowwise",
        "blocks.*.attn": "attention",
        "blocks.*.attn.q": "colwise",
        "blocks.*.attn.k": "colwise",
        "blocks.*.attn.v": "colwise",
        "blocks.*.attn.proj": "rowwise",
        "blocks.*.mlp.fc": "colwise",
        "blocks.*.mlp.proj": "rowwise",
        "lm_head": "colwise_gather_output",
    }

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialises every module with `_init_weights`, in `modules()` order."""
        for module in self.modules():
            self._init_weights(module)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 initialisation of one module: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layer).

        Per module, as in Hugging Face models, so a model built on the meta device can be initialised one module
        at a time (tp_train does this when it materialises each rank's shards)."""
        if isinstance(module, nn.Linear):
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if getattr(module, "residual_projection", False) else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ):
        """Returns logits (B, T, vocab_size), or (logits, loss) when `targets` (B, T) are given. With `cache`, `idx`
        continues the tokens it holds (their positions follow them) and their keys and values are added to it.
        `positions` (B, T) or (T,) are the tokens' positions, 0..T-1 (after the cached ones) by default."""
        B, T = idx.shape
        past = 0 if cache is None else len(cache)
        if past + T > self.config.block_size:
            raise ValueError(f"sequence length {past + T} exceeds block_size={self.config.block_size}")
        pos = torch.arange(past, past + T, device=idx.device) if positions is None else positions
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, n_embd)
        for block in self.blocks:
            x = block(x) if cache is None else block(x, cache)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
        return logits, loss
