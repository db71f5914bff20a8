"""Packed documents never attend across each other: with `document_separator`, the loss of a packed block equals the
token-weighted mean of each document's loss computed alone (positions restarting at each document), at cp=1 and
cp=2 (gloo ranks); without the mask the same comparison differs, which shows the mask matters."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from models.gpt import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tp_train.parallel.context_parallel.models import enable_context_parallel, mean_over_group, shard_targets

CONFIG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.0)
SEPARATOR = 0
ENDS = [[4, 11], [2, 9, 13]]  # where each row's documents end (the separator); documents cross cp=2's chunks


def _block():
    generator = torch.Generator().manual_seed(3)
    block = torch.randint(1, CONFIG["vocab_size"], (len(ENDS), CONFIG["block_size"] + 1), generator=generator)
    for row, ends in enumerate(ENDS):
        block[row, ends] = SEPARATOR
    return block[:, :-1], block[:, 1:]  # inputs, targets: shifted before any split


def _documents_alone(model):
    """Sum of per-token losses of each document run alone (its inputs from position 0), and the token count."""
    inputs, targets = _block()
    total, count = 0.0, 0
    for row, ends in enumerate(ENDS):
        starts = [0, *(end + 1 for end in ends)]
        for start, stop in zip(starts, [*(end + 1 for end in ends), inputs.shape[1]], strict=True):
            logits = model(inputs[row : row + 1, start:stop])
            total += F.cross_entropy(logits[0], targets[row, start:stop], reduction="sum").item()
            count += stop - start
    return total / count


def _rank_losses(rank, world_size, masked):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG))
    alone = _documents_alone(model)
    enable_context_parallel(model, dist.group.WORLD, document_separator=SEPARATOR if masked else None)
    inputs, targets = _block()
    local_targets = shard_targets(targets, model.tp_context_parallel)
    local = F.cross_entropy(model(inputs).flatten(0, 1), local_targets.flatten())
    packed = mean_over_group(local, torch.tensor(local_targets.numel()), dist.group.WORLD)
    return packed.item(), alone


def test_packed_block_loss_is_the_token_weighted_mean_of_each_document_alone():
    for world_size in (1, 2):
        for packed, alone in run_on_ranks(_rank_losses, world_size, True):
            assert abs(packed - alone) < 1e-5, f"cp={world_size}: packed {packed} vs documents alone {alone}"


def test_without_the_mask_the_packed_loss_differs():
    for packed, alone in run_on_ranks(_rank_losses, 2, False):
        assert abs(packed - alone) > 1e-3, f"unmasked packed {packed} vs documents alone {alone}: no difference seen"
