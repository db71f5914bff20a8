"""A small mixture-of-experts GPT in plain single-device PyTorch: each block's MLP is a top-k router over experts
whose weights are stacked in one tensor per matrix (as Hugging Face's Mixtral keeps them), with an optional shared
expert every token goes through. Nothing here knows about parallelism."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from models.gpt import GPT, MLP, GPTConfig


@dataclass
class MoEConfig(GPTConfig):
    n_expert: int = 8  # experts per block
    top_k: int = 2  # experts each token is routed to
    expert_hidden: int = 128  # hidden width of one expert's MLP
    shared_expert: bool = False  # also a dense MLP (4 x n_embd wide) that every token goes through


class Router(nn.Module):
    """Softmax over the experts' scores, the top k kept and renormalised to sum to 1 (Mixtral's routing)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.empty(config.n_expert, config.n_embd))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, n_embd) -> (T, top_k) weights, (T, top_k) expert ids."""
        probs = F.linear(x, self.weight).softmax(dim=-1)  # (T, n_expert)
        weights, index = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), index


class Experts(nn.Module):
    """`num_experts` GELU MLPs, their weights stacked: w_in (E, hidden, n_embd), w_out (E, n_embd, hidden)."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        self.num_experts = config.n_expert
        self.w_in = nn.Parameter(torch.empty(config.n_expert, config.expert_hidden, config.n_embd))
        self.w_out = nn.Parameter(torch.empty(config.n_expert, config.n_embd, config.expert_hidden))

    def forward(self, x: torch.Tensor, expert_index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x (T, n_embd), expert_index and weights (T, k) -> (T, n_embd): each token's experts' outputs, weighted."""
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(expert_index == expert)
            h = F.gelu(x[token] @ self.w_in[expert].t()) @ self.w_out[expert].t()
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


class MoEFeedForward(nn.Module):
    def __init__(self, config: MoEConfig):
        super().__init__()
        self.router = Router(config)
        self.experts = Experts(config)
        self.shared = MLP(config) if config.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        weights, index = self.router(flat)
        out = self.experts(flat, index, weights).reshape(B, T, C)
        return out + self.shared(x) if self.shared is not None else out


class MoEGPT(GPT):
    """GPT whose blocks' MLPs are `MoEFeedForward`s."""

    # Attention (and the shared expert, where there is one) split as GPT's blocks are; the router and the experts
    # stay whole on every tensor-parallel rank (experts are split across ranks whole, by expert parallelism).
    tp_plan = {name: style for name, style in GPT.tp_plan.items() if ".mlp." not in name}
    shared_expert_plan = {"blocks.*.mlp.shared.fc": "colwise", "blocks.*.mlp.shared.proj": "rowwise"}

    def __init__(self, config: MoEConfig):
        super().__init__(config)
        for block in self.blocks:
            block.mlp = MoEFeedForward(config)
        if config.shared_expert:
            self.tp_plan = {**MoEGPT.tp_plan, **self.shared_expert_plan}
        self.reset_parameters()

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, Router):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, Experts):
            nn.init.normal_(module.w_in, mean=0.0, std=0.02)
            nn.init.normal_(module.w_out, mean=0.0, std=0.02)
