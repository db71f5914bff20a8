"""Dropout under tensor parallelism: identical masks in replicated regions (or the replicas drift apart),
independent masks in sharded regions (each rank's local heads)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tp_train.parallel.random import REPLICATED, SHARDED

VOCAB = 64


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _train_with_dropout(rank, world_size, steps, device="cpu"):
    """On "cuda" the model and its dropout masks live on the GPU: the tracker switches CUDA's generator."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.2)).to(device)
    # Each rank's default generator starts elsewhere, as it would after per-rank seeding: parallelize must make
    # the replicated stream identical across the group or the replicas drift apart.
    torch.manual_seed(100 + rank)
    tp_train.parallelize(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(7)
    for _ in range(steps):
        idx = torch.randint(0, VOCAB, (4, 16), generator=data).to(device)
        logits = model(idx)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    replicated = {
        name: param.detach()
        for name, param in model.named_parameters()
        if name.startswith(("blocks.0.ln_1", "blocks.1.ln_2", "ln_f", "pos_emb"))
    }
    mismatch = {
        name: max((other - param).abs().max().item() for other in _gather(param)) for name, param in replicated.items()
    }
    rng = model.tp_rng
    rng.enter(SHARDED)
    sharded_draw = torch.rand(8, device=device)
    rng.exit()
    rng.enter(REPLICATED)
    replicated_draw = torch.rand(8, device=device)
    rng.exit()
    sharded_draws, replicated_draws = _gather(sharded_draw), _gather(replicated_draw)
    return {
        "replicated_params": mismatch,
        "sharded_streams_differ": all(not torch.equal(sharded_draws[0], d) for d in sharded_draws[1:]),
        "replicated_streams_equal": all(torch.equal(replicated_draws[0], d) for d in replicated_draws[1:]),
    }


@pytest.mark.parametrize("tp", [2, 4])
def test_replicated_params_stay_bit_identical_with_dropout(tp):
    check_dropout_streams(run_on_ranks(_train_with_dropout, tp, 10, timeout=180))


def check_dropout_streams(results: list[dict]) -> None:
    for result in results:
        assert len(result["replicated_params"]) == 7  # ln_1 and ln_2 weight+bias, ln_f weight+bias, pos_emb
        assert all(diff == 0.0 for diff in result["replicated_params"].values()), result["replicated_params"]
        assert result["sharded_streams_differ"]
        assert result["replicated_streams_equal"]
