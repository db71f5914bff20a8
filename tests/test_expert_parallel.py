"""Expert parallelism (`tp_train.parallel.experts`) on real gloo ranks: dispatch then combine returns the tokens
exactly, gradients included, for uneven counts; our MoE GPT (models/moe.py) with its experts split over ep ranks
trains like one process on the whole batch, with SGD and with AdamW."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.moe import MoEConfig, MoEGPT
from tests.distributed import run_on_ranks
from tp_train.parallel.experts import combine, dispatch, expert_capacity, shard_experts

TOKENS, WIDTH, EXPERTS = 12, 8, 8
ALL = 2 * TOKENS  # assignments per rank (top-2): a capacity no expert reaches


def _uneven_routes(rank: int, world_size: int) -> torch.Tensor:
    """(TOKENS, 2) expert ids: expert 1 gets no token on any rank; rank 0 sends every token to expert 0; the rest
    are drawn, so the counts each rank sends and receives differ."""
    generator = torch.Generator().manual_seed(rank)
    drawn = torch.randint(2, EXPERTS, (TOKENS, 2), generator=generator)
    drawn[:, 1] = (drawn[:, 0] + 1 + torch.randint(0, EXPERTS - 3, (TOKENS,), generator=generator)) % EXPERTS
    drawn[drawn == 1] = 0
    if rank == 0:
        drawn[:, 0] = 0
    return drawn


def _round_trip(rank, world_size):
    hidden = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(10 + rank)).requires_grad_()
    routes = _uneven_routes(rank, world_size)
    weights = torch.full((TOKENS, 2), 0.5)  # exact in binary: the two copies sum back to the token
    group = dist.group.WORLD
    rows, local_ids, per_expert, state = dispatch(hidden, routes, EXPERTS, group)
    local = EXPERTS // world_size
    # Each row is a token sent to one of this rank's experts: its id says which, and the rows are grouped by it.
    first = rank * local
    assert local_ids.tolist() == sorted(local_ids.tolist())
    assert per_expert.tolist() == torch.bincount(local_ids, minlength=local).tolist()
    out = combine(rows, weights, state, group)
    projection = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(20 + rank))
    (out * projection).sum().backward()
    counts = torch.bincount(routes.reshape(-1), minlength=EXPERTS)
    dist.all_reduce(counts)
    return (
        (out - hidden).abs().max().item(),
        (hidden.grad - projection).abs().max().item(),
        per_expert.tolist(),
        counts[first : first + local].tolist(),
        _capacity_checks(rank, hidden.detach(), routes, weights, projection, out, hidden.grad),
    )


def _kept_by_hand(routes: torch.Tensor, capacity: int) -> torch.Tensor:
    """(TOKENS, 2) whether each assignment fits its expert's capacity, first come (token, then choice) first kept."""
    taken, kept = [0] * EXPERTS, torch.zeros(routes.shape, dtype=torch.bool)
    for token, choices in enumerate(routes.tolist()):
        for choice, expert in enumerate(choices):
            kept[token, choice] = taken[expert] < capacity
            taken[expert] += 1
    return kept


def _capacity_checks(rank, hidden, routes, weights, projection, dropless_out, dropless_grad):
    """With a capacity no expert reaches (all of a rank's assignments), the same output and gradient as dropless,
    bit for bit; with capacity 2 (factor 2/3 here: ceil(2/3 x 12 x 2 / 8)), the assignments over it dropped: their
    count, the output (each token's kept copies, weighted) and its gradient as counted by hand."""
    group, results = dist.group.WORLD, {}
    assert expert_capacity(8.0, TOKENS, 2, EXPERTS) == ALL and expert_capacity(2 / 3, TOKENS, 2, EXPERTS) == 2
    for capacity in (ALL, 2):
        x = hidden.clone().requires_grad_()
        rows, _, _, state = dispatch(x, routes, EXPERTS, group, capacity)
        out = combine(rows, weights, state, group)
        (out * projection).sum().backward()
        kept = _kept_by_hand(routes, capacity)
        copies = (kept.float() * weights).sum(dim=1, keepdim=True)  # (TOKENS, 1) weight of each token's kept copies
        results[capacity] = (
            state.dropped,
            int((~kept).sum()),
            (out - copies * hidden).abs().max().item(),
            (x.grad - copies * projection).abs().max().item(),
            torch.equal(out, dropless_out) and torch.equal(x.grad, dropless_grad),
        )
    return results


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatch_then_combine_returns_the_tokens_and_their_gradients(ep):
    results = run_on_ranks(_round_trip, ep, timeout=60)
    for rank, (output_error, grad_error, received, routed, capacity) in enumerate(results):
        assert output_error == 0.0 and grad_error == 0.0, (rank, output_error, grad_error)
        assert received == routed, (rank, received, routed)  # each expert got every token routed to it, once
        assert capacity[ALL] == (0, 0, 0.0, 0.0, True), (rank, capacity[ALL])  # large: dropless exactly
        dropped, by_hand, output_error, grad_error, _ = capacity[2]
        assert dropped == by_hand and output_error == 0.0 and grad_error == 0.0, (rank, capacity[2])
    assert results[0][4][2][0] >= TOKENS - 2  # rank 0's expert 0 keeps 2 of its 12 tokens or more
    assert results[0][2][0] >= TOKENS and results[0][2][1] == 0  # expert 0 got all of rank 0's tokens; expert 1 none


CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False, n_expert=8, top_k=2,
              expert_hidden=24)  # fmt: skip
BATCH, STEPS = 8, 10
EXPERT_PARAMETERS = ("experts.w_in", "experts.w_out", "experts.gate_up_proj", "experts.down_proj")


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(
        0, 64, (BATCH, 13), generator=torch.Generator().manual_seed(100 + step % 2)
    )  # two batches, learnt
    return tokens[:, :-1], tokens[:, 1:]


def _optimizer(model, name: str):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.5)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _our_moe(shared_expert: bool):
    model = MoEGPT(MoEConfig(**CONFIG, shared_expert=shared_expert))
    return model, [f"blocks.{i}.mlp.experts" for i in range(len(model.blocks))], lambda idx: model(idx)


def _mixtral(shared_expert: bool):
    """Hugging Face's Mixtral, tiny: its own MixtralExperts run expert-parallel unchanged."""
    from models.hf import hugging_face_causal_lm

    fields = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, num_local_experts=EXPERTS, num_experts_per_tok=2)  # fmt: skip
    model = hugging_face_causal_lm("mixtral", config=fields)
    names = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    return model, names, lambda idx: model(idx).logits


MODELS = {"ours": _our_moe, "mixtral": _mixtral}


def _train(rank, world_size, optimizer_name, shared_expert, family="ours"):
    """Each rank trains on its share of every batch with its experts' run; the dense gradients are averaged over
    the ranks (DDP's convention), the experts' scaled to the same average. Returns each step's whole-batch loss and
    the final parameters, the experts' gathered."""
    torch.manual_seed(0)
    model, names, logits = MODELS[family](shared_expert)
    group = dist.group.WORLD
    if world_size > 1:
        shard_experts(model, names, group, gradient_scale=1 / world_size)
    optimizer = _optimizer(model, optimizer_name)
    share = BATCH // world_size
    losses = []
    for step in range(STEPS):
        idx, targets = (part[rank * share : (rank + 1) * share] for part in _batch(step))
        loss = F.cross_entropy(logits(idx).flatten(0, 1), targets.flatten())
        loss.backward()
        for name, param in model.named_parameters():
            if not name.endswith(EXPERT_PARAMETERS) and world_size > 1:
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        losses.append(total.item())
    params = {}
    for name, param in model.named_parameters():
        if name.endswith(EXPERT_PARAMETERS) and world_size > 1:
            pieces = [torch.empty_like(param) for _ in range(world_size)]
            dist.all_gather(pieces, param.detach().contiguous())
            params[name] = torch.cat(pieces)
        else:
            params[name] = param.detach().clone()
    return losses, params


@pytest.mark.parametrize(
    "ep, optimizer_name, shared_expert",
    [(2, "sgd", False), (2, "adamw", True), pytest.param(4, "adamw", False, marks=pytest.mark.slow)],
)
def test_our_moe_at_ep_trains_like_one_process(ep, optimizer_name, shared_expert):
    (reference_losses, reference), *_ = run_on_ranks(_train, 1, optimizer_name, shared_expert, timeout=120)
    for rank, (losses, params) in enumerate(run_on_ranks(_train, ep, optimizer_name, shared_expert, timeout=180)):
        assert max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)) < 1e-5, (rank, losses)
        assert reference_losses[-1] < reference_losses[0] - 0.1  # it trains
        for name, value in params.items():
            assert (value - reference[name]).abs().max().item() < 1e-5, (rank, name)


def test_hugging_face_mixtral_at_ep_2_trains_like_one_process():
    (reference_losses, reference), *_ = run_on_ranks(_train, 1, "adamw", False, "mixtral", timeout=120)
    for rank, (losses, params) in enumerate(run_on_ranks(_train, 2, "adamw", False, "mixtral", timeout=180)):
        assert max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True)) < 1e-5, (rank, losses)
        for name, value in params.items():
            assert (value - reference[name]).abs().max().item() < 1e-5, (rank, name)


@pytest.mark.parametrize(
    "family, fields",
    [("mixtral", {"num_local_experts": 8}), ("qwen3_moe", {"num_experts": 8}), ("gpt_oss", {"num_local_experts": 8})],
)
def test_under_expert_parallelism_a_family_plan_splits_the_attention_and_keeps_the_experts_whole(family, fields):
    """One rule in the plan reader for every family: with `experts_whole` (ep > 1) Hugging Face's and the family
    record's entries on the experts modules are dropped, the attention's kept; without it they split the experts."""
    from models.hf import hugging_face_causal_lm
    from tp_train.plan.deciding.resolve import EXPERTS_KEPT_WHOLE, resolve_plan

    config = dict(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, num_experts_per_tok=2, **fields)  # fmt: skip
    with torch.device("meta"):
        model = hugging_face_causal_lm(family, config=config)
    split, _ = resolve_plan(model, tensor_parallel_size=2)
    whole, source = resolve_plan(model, tensor_parallel_size=2, experts_whole=True)
    assert any(".mlp.experts" in pattern for pattern in split), split
    assert not any(".mlp.experts" in pattern for pattern in whole), whole
    assert EXPERTS_KEPT_WHOLE in source, source
    attention = {pattern: style for pattern, style in split.items() if ".self_attn" in pattern}
    assert attention and all(whole[pattern] == style for pattern, style in attention.items()), whole
