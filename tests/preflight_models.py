"""A model whose widths are set independently (models.GPT derives them from each other), so that each preflight
size check can be failed on its own from the command line:

    python train.py model._target_=tests.preflight_models.SizedLM +model.kv_heads=1 tp=2
"""

from __future__ import annotations

from types import SimpleNamespace

import torch.nn as nn


class SizedLM(nn.Module):
    """Embedding, one attention's q/k/v/out and one MLP, shaped by the arguments (preflight builds it on meta)."""

    tp_plan = {"attn.q": "colwise", "attn.kv": "colwise", "attn.out": "rowwise", "fc": "colwise", "proj": "rowwise"}

    def __init__(self, config, width: int = 64, heads: int | None = 4, kv_heads: int | None = None,
                 ffn: int = 256, planned: bool = True) -> None:  # fmt: skip
        super().__init__()
        kv_heads = kv_heads or heads
        head_dim = width // heads if heads else 1
        self.config = SimpleNamespace(block_size=config.block_size, num_attention_heads=heads,
                                      num_key_value_heads=kv_heads)  # fmt: skip
        self.embed = nn.Embedding(config.vocab_size, width)
        self.attn = nn.Module()
        self.attn.q = nn.Linear(width, width)
        self.attn.kv = nn.Linear(width, 2 * (kv_heads or width) * head_dim)
        self.attn.out = nn.Linear(width, width)
        self.fc, self.proj = nn.Linear(width, ffn), nn.Linear(ffn, width)
        if not planned:
            self.tp_plan = None
