"""The collectives in `tp_train.parallel.collectives`: forward value and backward gradient of each, as its
docstring states them.

Every rank builds every rank's input and output gradient from `seed + rank`, so the expected values are computed by
hand from full tensors. Output gradients differ per rank on purpose: a backward that forgot to sum, or summed what it
should only have sliced, shows up as a wrong value. All checks for one tp run in a single spawn.
"""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run_on_ranks
from tp_train.parallel.collectives import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    reduce_scatter_to_tensor_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)

BATCH, SEQUENCE, HIDDEN = 2, 8, 12  # sequence and hidden divisible by every tested tp
PRIMITIVES = 8
CHECKS = 2 * PRIMITIVES + 1  # forward and backward of each, plus the reduce-from input-untouched check


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _per_rank(seed: int, world_size: int, *shape: int) -> list[torch.Tensor]:
    """What every rank's per-rank tensor is, rank r's drawn from `seed + r`."""
    return [_randn(seed + r, *shape) for r in range(world_size)]


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual - expected).abs().max().item()


def _run(primitive, x: torch.Tensor, grad: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """The primitive's output and the gradient it sends back to `x` for the output gradient `grad`."""
    x = x.clone().requires_grad_()
    out = primitive(x, group)
    out.backward(grad)
    return out.detach(), x.grad


def _comm_checks(rank: int, world_size: int) -> dict[str, float]:
    group = dist.group.WORLD
    full = (BATCH, SEQUENCE, HIDDEN)
    hidden_shard = (BATCH, SEQUENCE, HIDDEN // world_size)
    sequence_shard = (BATCH, SEQUENCE // world_size, HIDDEN)
    replicated = _randn(0, *full)
    errors = {}

    def check(name, primitive, x, grads, expected_out, expected_grad):
        out, x_grad = _run(primitive, x, grads[rank], group)
        errors[f"{name}/forward"] = _error(out, expected_out)
        errors[f"{name}/backward"] = _error(x_grad, expected_grad)

    # f: identity forward, all-reduce backward.
    grads = _per_rank(100, world_size, *full)
    check("copy_to_tp", copy_to_tensor_parallel_region, replicated, grads, replicated, sum(grads))

    # g: all-reduce forward, identity backward.
    inputs = _per_rank(200, world_size, *full)
    grads = _per_rank(300, world_size, *full)
    check("reduce_from_tp", reduce_from_tensor_parallel_region, inputs[rank], grads, sum(inputs), grads[rank])
    before = inputs[rank].clone()
    reduce_from_tensor_parallel_region(inputs[rank], group)
    errors["reduce_from_tp/input_untouched"] = _error(inputs[rank], before)

    # Last-dim split forward, all-gather backward.
    grads = _per_rank(400, world_size, *hidden_shard)
    expected = replicated.chunk(world_size, dim=-1)[rank]
    check("scatter_to_tp", scatter_to_tensor_parallel_region, replicated, grads, expected, torch.cat(grads, dim=-1))

    # Last-dim all-gather forward, split backward (no communication).
    inputs = _per_rank(500, world_size, *hidden_shard)
    grads = _per_rank(600, world_size, *full)
    expected, expected_grad = torch.cat(inputs, dim=-1), grads[rank].chunk(world_size, dim=-1)[rank]
    check("gather_from_tp", gather_from_tensor_parallel_region, inputs[rank], grads, expected, expected_grad)

    # Sequence split forward, all-gather backward.
    grads = _per_rank(700, world_size, *sequence_shard)
    expected = replicated.chunk(world_size, dim=1)[rank]
    check("scatter_to_sp", scatter_to_sequence_parallel_region, replicated, grads, expected, torch.cat(grads, dim=1))

    # Sequence all-gather forward, reduce-scatter backward.
    inputs = _per_rank(800, world_size, *sequence_shard)
    grads = _per_rank(900, world_size, *full)
    expected, expected_grad = torch.cat(inputs, dim=1), sum(grads).chunk(world_size, dim=1)[rank]
    check("gather_from_sp", gather_from_sequence_parallel_region, inputs[rank], grads, expected, expected_grad)

    # Reduce-scatter forward, sequence all-gather backward.
    inputs = _per_rank(1000, world_size, *full)
    grads = _per_rank(1100, world_size, *sequence_shard)
    expected, expected_grad = sum(inputs).chunk(world_size, dim=1)[rank], torch.cat(grads, dim=1)
    check(
        "reduce_scatter_to_sp", reduce_scatter_to_sequence_parallel_region, inputs[rank], grads, expected, expected_grad
    )

    # Last-dim reduce-scatter forward, last-dim all-gather backward (a row layer whose output each rank keeps its
    # share of: Doge's dt_proj).
    inputs = _per_rank(1200, world_size, *full)
    grads = _per_rank(1300, world_size, *hidden_shard)
    expected, expected_grad = sum(inputs).chunk(world_size, dim=-1)[rank], torch.cat(grads, dim=-1)
    check(
        "reduce_scatter_to_tp", reduce_scatter_to_tensor_parallel_region, inputs[rank], grads, expected, expected_grad
    )

    # The comparison must be able to fail: the gather's output against shards concatenated in the wrong order.
    inputs = _per_rank(500, world_size, *hidden_shard)
    misordered = torch.cat(inputs[1:] + inputs[:1], dim=-1)
    return errors, _error(gather_from_tensor_parallel_region(inputs[rank], group), misordered)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_collectives_match_their_docstrings(tp):
    results = run_on_ranks(_comm_checks, tp, timeout=120)
    for rank, (errors, misordered_error) in enumerate(results):
        assert len(errors) == CHECKS, sorted(errors)
        bad = {name: error for name, error in errors.items() if not error < 1e-5}
        assert not bad, f"rank {rank} of {tp}: {bad}"
        if tp > 1:
            assert misordered_error > 0.1, f"rank {rank}: a mis-ordered gather went unnoticed"
