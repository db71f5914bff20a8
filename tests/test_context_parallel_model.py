"""Our GPT trained context-parallel on real gloo ranks equals one process: 5 optimizer steps, losses within 1e-5
(fp32), at cp=2 (ring and alltoall), tp=2 x cp=2 and dp=2 x cp=2, with sequence parallelism and activation
checkpointing on; and heads that do not divide by cp are refused in one line under alltoall."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from models.gpt import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tp_train.parallel.context_parallel.models import mean_over_group, shard_targets
from tp_train.plan.parallelize import parallelize

CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
STEPS, BATCH, LENGTH, LR = 5, 4, 16, 0.5


def _batches():
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, CONFIG["vocab_size"], (BATCH, LENGTH + 1), generator=generator)
    return [batch] * STEPS  # the same batch: its loss falls step after step


def _one_process_losses():
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in _batches():
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _rank_losses(rank, world_size, dp, cp, tp, sequence_parallel, activation_checkpointing, rotation):
    names = ("data_parallel", "context_parallel", "tensor_parallel")
    mesh = init_device_mesh("cpu", (dp, cp, tp), mesh_dim_names=names)
    replicas = mesh["data_parallel", "context_parallel"]._flatten("data_context_parallel").get_group()
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    parallelize(
        model,
        mesh["tensor_parallel"].get_group(),
        verify=False,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
        cp_group=mesh["context_parallel"].get_group(),
        cp_options={"rotation": rotation},
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    dp_rank, per_replica = mesh["data_parallel"].get_local_rank(), BATCH // dp
    losses = []
    for batch in _batches():
        batch = batch[dp_rank * per_replica : (dp_rank + 1) * per_replica]
        logits = model(batch[:, :-1])  # (B, T / cp, vocab): this rank's tokens
        targets = shard_targets(batch[:, 1:], model.tp_context_parallel)
        local = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss = mean_over_group(local, torch.tensor(targets.numel()), mesh["context_parallel"].get_group())
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():  # what DDP over dp x cp does
            dist.all_reduce(parameter.grad, group=replicas)
            parameter.grad /= dp * cp
        optimizer.step()
        value = loss.detach().clone()
        dist.all_reduce(value, group=mesh["data_parallel"].get_group())
        losses.append(value.item() / dp)
    return losses


def _check(dp, cp, tp, sequence_parallel=False, activation_checkpointing=False, rotation="ring"):
    expected = _one_process_losses()
    by_rank = run_on_ranks(
        _rank_losses, dp * cp * tp, dp, cp, tp, sequence_parallel, activation_checkpointing, rotation
    )  # fmt: skip
    worst = max(abs(a - b) for losses in by_rank for a, b in zip(losses, expected, strict=True))
    assert worst < 1e-5, f"dp={dp} cp={cp} tp={tp} {rotation}: {by_rank[0]} vs one process {expected} ({worst:.2e})"
    assert expected[-1] < expected[0] - 0.05, expected  # the steps do train


@pytest.mark.parametrize("rotation", ["ring", "alltoall"])
def test_cp2_equals_one_process(rotation):
    _check(1, 2, 1, rotation=rotation)


def _rank_refusal(rank, world_size):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(CONFIG, n_head=3, n_embd=24)))
    mesh = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("context_parallel", "tensor_parallel"))
    groups = {name: mesh[name].get_group() for name in ("context_parallel", "tensor_parallel")}
    parallelize(model, groups["tensor_parallel"], verify=False, cp_group=groups["context_parallel"],
                cp_options={"rotation": "alltoall"})  # fmt: skip
    try:
        model(_batches()[0][:, :-1])
    except ValueError as error:
        return str(error)
    return None


def test_alltoall_refuses_heads_not_dividing_by_cp_in_one_line():
    messages = run_on_ranks(_rank_refusal, 2)
    assert messages[0] == messages[1], messages
    assert "\n" not in messages[0], messages[0]
    assert messages[0].startswith("blocks.0.attn: 3 query heads per rank (after tensor parallelism) do not divide by "
                                  "cp=2"), messages[0]  # fmt: skip
    assert "use cp in [3] or rotation 'ring' or 'allgather'" in messages[0], messages[0]


@pytest.mark.slow
def test_tp2_cp2_sequence_parallel_checkpointed_equals_one_process():
    _check(1, 2, 2, sequence_parallel=True, activation_checkpointing=True)


@pytest.mark.slow
def test_dp2_cp2_checkpointed_equals_one_process():
    _check(2, 2, 1, activation_checkpointing=True)
