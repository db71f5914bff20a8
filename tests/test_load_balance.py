"""The load-balancing loss over the global batch (tp_train.parallel.experts.load_balance) on real gloo ranks, each
routing its own rows: its value is Hugging Face's `load_balancing_loss_func` over all ranks' rows, and its
gradients, averaged over the ranks as DDP averages them, are that function's gradients (1e-6), at 1, 2 and 4
ranks, and at 4 ranks as 2 data-parallel x 2 tensor-parallel ranks under sequence parallelism (each of a pair
routing its own half of the pair's rows; their router gradients summed, as sequence parallelism sums them)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from tests.distributed import run_on_ranks
from tp_train.parallel.experts.load_balance import load_balancing_loss

LAYERS, ROWS, EXPERTS, TOP_K = 3, 6, 8, 2


def _all_logits(world_size: int) -> list[torch.Tensor]:
    """Each layer's (world_size * ROWS, E) router logits, rank r's rows at [r * ROWS, (r + 1) * ROWS)."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(world_size * ROWS, EXPERTS, generator=generator) for _ in range(LAYERS)]


def _errors(rank, world_size):
    """(value error, gradient error) of this rank's rows against the function on all rows in one process, for
    each split of the ranks: the whole world, and (at 4 ranks) pairs of ranks as two groups of 2."""
    splits = {world_size: dist.group.WORLD}
    if world_size == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        splits[2] = pairs[rank // 2]
    errors = {}
    for size, group in splits.items():
        full = [logits.requires_grad_() for logits in _all_logits(size)]
        reference = load_balancing_loss_func(tuple(full), EXPERTS, TOP_K)
        reference.backward()
        index = rank % size
        mine = [logits.detach()[index * ROWS : (index + 1) * ROWS].clone().requires_grad_() for logits in full]
        loss, loads = load_balancing_loss(mine, EXPERTS, TOP_K, group)
        assert loads.shape == (LAYERS, EXPERTS) and loads.sum().item() == LAYERS * size * ROWS * TOP_K
        loss.backward()
        grad_error = max(
            (m.grad / size - f.grad[index * ROWS : (index + 1) * ROWS]).abs().max().item()
            for m, f in zip(mine, full, strict=True)
        )
        errors[size] = ((loss - reference).abs().item(), grad_error, reference.item())
    if world_size == 4:  # data-parallel pairs {0, 2} and {1, 3}, tensor-parallel pairs {0, 1} and {2, 3}
        data = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
        tensor = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
        full = [logits.requires_grad_() for logits in _all_logits(world_size)]
        reference = load_balancing_loss_func(tuple(full), EXPERTS, TOP_K)
        reference.backward()
        rows = slice(rank * ROWS, (rank + 1) * ROWS)  # rank (d, t) = 2d + t: its data-parallel rows' half t
        mine = [logits.detach()[rows].clone().requires_grad_() for logits in full]
        loss, loads = load_balancing_loss(mine, EXPERTS, TOP_K, data, sequence_group=tensor)
        assert loads.sum().item() == LAYERS * world_size * ROWS * TOP_K
        loss.backward()
        grad_error = max((m.grad / 2 - f.grad[rows]).abs().max().item() for m, f in zip(mine, full, strict=True))
        errors["dp2 x tp2, sequence parallel"] = ((loss - reference).abs().item(), grad_error, reference.item())
    return errors


def test_load_balancing_loss_over_the_global_batch_at_1_2_and_4_ranks():
    results = run_on_ranks(_errors, 4, timeout=120) + run_on_ranks(_errors, 1, timeout=60)
    for errors in results:
        for size, (value_error, grad_error, reference) in errors.items():
            assert value_error < 1e-6 and grad_error < 1e-6, (size, value_error, grad_error)
            assert reference > TOP_K * 0.9  # a real loss (k at perfect balance), not a zero that matches trivially
