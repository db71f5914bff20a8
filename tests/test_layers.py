"""Parity of the tensor-parallel layers and the vocab-parallel loss with their unsharded references.

Every rank builds the full `nn.Linear` / `nn.Embedding` from a fixed seed, fills the parallel layer with its shard
(`shard_tensor`), runs both on the same input and output gradient, and compares outputs, input gradients and
parameter gradients (sharded gradients gathered with `unshard_tensor`). All checks for one tp run in a single spawn.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tp_train.parallel.sharding import ShardSpec, shard_tensor, unshard_tensor

TOKENS = (2, 6)  # (batch, sequence)
IN_FEATURES, OUT_FEATURES = 6, 8
VOCAB = 37  # not divisible by 2 or 4
PADDED_VOCAB = 40  # a sharded logits width with padding past VOCAB at every tested tp
PADDING_IDX = 12
# Linear configs x (output, input, weight, bias) + row x 4 + embedding x 2 + losses x (loss, grad) + all-ignored.
# ... + gathered fused column + negative padding_idx + a row layer keeping its share of the output.
CHECKS = 6 * 4 + 4 + 2 + 4 * 2 + 1 + 4 + 2 + 4
ATOL = 1e-5


def _randn(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return (actual - expected).abs().max().item()


def _fill(layer: nn.Module, reference: nn.Module, rank: int, world_size: int, shard_rank: int | None = None):
    """Copies the reference's parameters into `layer`: sharded ones as this rank's shard, the rest whole."""
    source_rank = rank if shard_rank is None else shard_rank
    with torch.no_grad():
        for name, param in layer.named_parameters():
            full = getattr(reference, name).detach()
            spec = layer.shard_specs.get(name)
            param.copy_(full if spec is None else shard_tensor(full, spec, source_rank, world_size))


def _parameter_grad_errors(errors: dict, prefix: str, layer: nn.Module, reference: nn.Module, group):
    for name, param in layer.named_parameters():
        spec = layer.shard_specs.get(name)
        grad = param.grad if spec is None else unshard_tensor(param.grad, spec, group)
        errors[f"{prefix}/{name}_grad"] = _error(grad, getattr(reference, name).grad)


def _reference_linear(in_features: int, out_features: int) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(in_features, out_features)


def _column_errors(errors, name, rank, world_size, group, out_features, **kwargs):
    reference = _reference_linear(IN_FEATURES, out_features)
    layer = ColumnParallelLinear(IN_FEATURES, out_features, group, **kwargs)
    _fill(layer, reference, rank, world_size)
    x, grad = _randn(1, *TOKENS, IN_FEATURES), _randn(2, *TOKENS, out_features)
    reference_x = x.clone().requires_grad_()
    expected = reference(reference_x)
    expected.backward(grad)
    expected = expected.detach()
    if not layer.gather_output:
        # This rank's slice of the full output, in the weight's sharded layout (sections, padding).
        weight_spec = layer.shard_specs["weight"]
        output_spec = ShardSpec(dim=len(TOKENS), sections=weight_spec.sections, padded=weight_spec.padded)
        expected = shard_tensor(expected, output_spec, rank, world_size)
        grad = shard_tensor(grad, output_spec, rank, world_size)
    x.requires_grad_()
    out = layer(x)
    out.backward(grad)
    errors[f"{name}/output"] = _error(out.detach(), expected)
    errors[f"{name}/input_grad"] = _error(x.grad, reference_x.grad)
    _parameter_grad_errors(errors, name, layer, reference, group)


def _row_errors(errors, name, rank, world_size, group, out_features, **kwargs):
    reference = _reference_linear(OUT_FEATURES, out_features)
    layer = RowParallelLinear(OUT_FEATURES, out_features, group, **kwargs)
    _fill(layer, reference, rank, world_size)
    x, grad = _randn(3, *TOKENS, OUT_FEATURES), _randn(4, *TOKENS, out_features)
    reference_x = x.clone().requires_grad_()
    expected = reference(reference_x)
    expected.backward(grad)
    expected = expected.detach()
    if layer.scatter_output:  # this rank's share of the summed output's features, and of their gradient
        output_spec = ShardSpec(dim=len(TOKENS), sections=(out_features,))
        expected, grad = (
            shard_tensor(expected, output_spec, rank, world_size),
            shard_tensor(grad, output_spec, rank, world_size),
        )
    input_spec = ShardSpec(dim=len(TOKENS), sections=(OUT_FEATURES,))
    local_x = shard_tensor(x, input_spec, rank, world_size).requires_grad_()
    out = layer(local_x)
    out.backward(grad)
    errors[f"{name}/output"] = _error(out.detach(), expected)  # a bias added per rank would show here
    errors[f"{name}/input_grad"] = _error(unshard_tensor(local_x.grad, input_spec, group), reference_x.grad)
    _parameter_grad_errors(errors, name, layer, reference, group)


def _embedding_errors(errors, name, rank, world_size, group, padding_idx):
    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, 5, padding_idx=padding_idx)
    layer = VocabParallelEmbedding(VOCAB, 5, group, padding_idx=padding_idx)
    _fill(layer, reference, rank, world_size)
    # Every id once (so every rank's range), then repeats, the padding row among them.
    repeats = torch.tensor([0, 36, 12, 12, 19, 20, 9, 10, 29, 30, 12])
    ids = torch.cat([torch.randperm(VOCAB, generator=torch.Generator().manual_seed(5)), repeats]).view(2, 24)
    grad = _randn(6, 2, 24, 5)
    expected = reference(ids)
    expected.backward(grad)
    out = layer(ids)
    out.backward(grad)
    errors[f"{name}/output"] = _error(out.detach(), expected.detach())
    _parameter_grad_errors(errors, name, layer, reference, group)


def _cross_entropy_errors(errors, name, rank, world_size, group, vocab_size, ignore=False, label_smoothing=0.0):
    logits = 3 * _randn(7, *TOKENS, PADDED_VOCAB)
    logits[..., vocab_size:] += 5  # padding columns large, so counting any of them changes the loss
    # Targets in every rank's range at tp=4, including the last real id.
    target = torch.tensor([0, 9, 10, 19, 20, 29, 30, vocab_size - 1, 5, 14, 25, 33]).view(TOKENS)
    if ignore:
        target.view(-1)[[2, 8, 11]] = -100
    reference_logits = logits.clone().requires_grad_()
    flat = reference_logits[..., :vocab_size].flatten(0, -2)
    expected = F.cross_entropy(flat, target.flatten(), label_smoothing=label_smoothing)
    (1.5 * expected).backward()  # a grad_output other than one
    # The reference never saw the padding columns, so their expected gradient is zero.
    expected_grad = reference_logits.grad.chunk(world_size, dim=-1)[rank]
    local = logits.chunk(world_size, dim=-1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        local,
        target,
        group,
        vocab_size=vocab_size,
        label_smoothing=label_smoothing,
    )
    (1.5 * loss).backward()
    errors[f"{name}/loss"] = _error(loss.detach(), expected.detach())
    errors[f"{name}/logits_grad"] = _error(local.grad, expected_grad)


def _layer_checks(rank: int, world_size: int):
    group = dist.group.WORLD
    errors = {}
    _column_errors(errors, "column", rank, world_size, group, OUT_FEATURES)
    _column_errors(errors, "column_gathered", rank, world_size, group, OUT_FEATURES, gather_output=True)
    # Without overlap the input gradient's all-reduce is `copy_to_tensor_parallel_region`'s, not the overlapped one's.
    _column_errors(errors, "column_not_overlapped", rank, world_size, group, OUT_FEATURES, overlap=False)
    _column_errors(errors, "column_sections", rank, world_size, group, 24, sections=(4, 12, 8))
    _column_errors(errors, "column_padded", rank, world_size, group, 10, pad_output=True)
    _column_errors(errors, "column_padded_gathered", rank, world_size, group, 10, pad_output=True, gather_output=True)
    _row_errors(errors, "row", rank, world_size, group, IN_FEATURES)
    _embedding_errors(errors, "embedding", rank, world_size, group, PADDING_IDX)
    _cross_entropy_errors(errors, "cross_entropy", rank, world_size, group, PADDED_VOCAB)
    _cross_entropy_errors(errors, "cross_entropy_ignore_index", rank, world_size, group, PADDED_VOCAB, ignore=True)
    _cross_entropy_errors(
        errors, "cross_entropy_label_smoothing", rank, world_size, group, PADDED_VOCAB, ignore=True, label_smoothing=0.1
    )
    _cross_entropy_errors(
        errors, "cross_entropy_padded_vocab", rank, world_size, group, VOCAB, ignore=True, label_smoothing=0.1
    )
    all_ignored = vocab_parallel_cross_entropy(
        _randn(8, 4, PADDED_VOCAB).chunk(world_size, dim=-1)[rank], torch.full((4,), -100), group, PADDED_VOCAB
    )
    errors["cross_entropy_all_ignored/loss_is_nan"] = 0.0 if all_ignored.isnan() else float("inf")

    _column_errors(
        errors, "column_sections_gathered", rank, world_size, group, 24, sections=(4, 12, 8), gather_output=True
    )
    _embedding_errors(errors, "embedding_negative_padding_idx", rank, world_size, group, padding_idx=-1)
    _row_errors(errors, "row_scatter_output", rank, world_size, group, 4, scatter_output=True)

    # The comparison must be able to fail: a column layer holding the next rank's shard.
    reference = _reference_linear(IN_FEATURES, OUT_FEATURES)
    layer = ColumnParallelLinear(IN_FEATURES, OUT_FEATURES, group)
    _fill(layer, reference, rank, world_size, shard_rank=(rank + 1) % world_size)
    x = _randn(1, *TOKENS, IN_FEATURES)
    expected = reference(x).chunk(world_size, dim=-1)[rank]
    return errors, _error(layer(x).detach(), expected.detach())


@functools.cache
def _results(tp: int):
    """One spawn per tp, shared by every test below."""
    return run_on_ranks(_layer_checks, tp, timeout=120)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_layers_and_loss_match_unsharded_reference(tp):
    for rank, (errors, misordered_error) in enumerate(_results(tp)):
        assert len(errors) == CHECKS, sorted(errors)
        bad = {name: error for name, error in errors.items() if not error < ATOL}
        assert not bad, f"rank {rank} of {tp}: {bad}"
        if tp > 1:
            assert misordered_error > 0.1, f"rank {rank}: a column layer holding the wrong shard went unnoticed"


def _direct_construction(rank, world_size):
    """Layers built directly (not by parallelize) start as slices of the unsharded layer's default init."""
    group = dist.group.WORLD
    errors = {}
    pairs = {
        "column": (lambda: nn.Linear(8, 12), lambda: ColumnParallelLinear(8, 12, group)),
        "column_padded": (lambda: nn.Linear(8, 10), lambda: ColumnParallelLinear(8, 10, group, pad_output=True)),
        "row": (lambda: nn.Linear(12, 8), lambda: RowParallelLinear(12, 8, group)),
        "embedding": (lambda: nn.Embedding(37, 4, padding_idx=3), lambda: VocabParallelEmbedding(37, 4, group, 3)),
    }
    for name, (build_reference, build_layer) in pairs.items():
        torch.manual_seed(0)
        reference = build_reference()
        torch.manual_seed(0)
        layer = build_layer()
        for param_name, param in layer.named_parameters():
            spec = layer.shard_specs.get(param_name)
            full = unshard_tensor(param.detach(), spec, group) if spec is not None else param.detach()
            errors[f"{name}/{param_name}"] = (getattr(reference, param_name).detach() - full).abs().max().item()
    try:
        RowParallelLinear(9, 8, group)
        errors["row_indivisible_raises"] = float("inf") if world_size in (2, 4) else 0.0
    except ValueError as error:
        errors["row_indivisible_raises"] = 0.0 if "in_features=9 is not divisible" in str(error) else float("inf")
    return errors


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_directly_built_layers_start_as_slices_of_the_unsharded_init(tp):
    for errors in run_on_ranks(_direct_construction, tp):
        assert len(errors) == 8 and max(errors.values()) == 0.0, errors


# (full shape, spec, dtype): sections, padding, a transposed weight, a replicated unit, and a second dtype.
UNSHARD_CASES = [
    ((12, 6), ShardSpec(0, (4, 8)), torch.float32),
    ((VOCAB, 6), ShardSpec(0, (VOCAB,), padded=True), torch.float32),
    ((6, 8), ShardSpec(0, (8,), transposed=True), torch.float32),  # stored (in, out), split along out
    ((16, 3), ShardSpec(0, (8, 8), units=(1, 4)), torch.float32),  # one kv head held whole by every rank
    ((8, 4), ShardSpec(1, (4,)), torch.bfloat16),
    ((8,), ShardSpec(0, (8,)), torch.float32),
]


def _unshard_many(rank, world_size, bucket_bytes):
    """Each case's full tensor from its shards, gathered by `unshard_tensors` in one call, against the full tensor
    itself; and how many all-gathers that call issued."""
    from tp_train.parallel import sharding

    fulls, shards = [], []
    for seed, (shape, spec, dtype) in enumerate(UNSHARD_CASES):
        full = _randn(seed, *shape).to(dtype)
        fulls.append(full)
        shards.append((shard_tensor(full.t() if spec.transposed else full, spec, rank, world_size), spec))
    gathers, all_gather = [], dist.all_gather
    sharding.dist.all_gather = lambda *args, **kwargs: (gathers.append(1), all_gather(*args, **kwargs))[1]
    try:
        gathered = sharding.unshard_tensors(shards, dist.group.WORLD, bucket_bytes=bucket_bytes)
    finally:
        sharding.dist.all_gather = all_gather
    same = [bool(torch.equal(actual, full)) for actual, full in zip(gathered, fulls, strict=True)]
    return same, len(gathers)


@pytest.mark.parametrize("tp", [2, 4])
def test_unshard_tensors_gives_each_full_tensor_in_one_all_gather_per_bucket(tp):
    """One all-gather per dtype (fp32, bf16) where the buckets hold everything; one per tensor where a bucket holds
    one; the full tensors bit for bit either way."""
    for bucket_bytes, gathers in ((2**20, 2), (1, len(UNSHARD_CASES))):
        for rank, (same, issued) in enumerate(run_on_ranks(_unshard_many, tp, bucket_bytes)):
            assert all(same), (rank, bucket_bytes, same)
            assert issued == gathers, (rank, bucket_bytes, issued)
