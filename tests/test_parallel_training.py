"""`ParallelTraining.batch_loss`, the loss a step loop logs: the whole batch's, as one process computes it, from each
rank's share. On real gloo ranks: dp=2 x cp=2 (four shares of different sizes, one of them all padding) and tp=2
(both ranks hold the same tokens, so nothing is reduced)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from tests.distributed import run_on_ranks

# per rank: (the mean of its tokens' losses, how many tokens it counted); rank 3's targets are all ignored
SHARES = [(2.0, 5), (4.0, 3), (1.0, 8), (float("nan"), 0)]


def _batch_loss(rank, world_size, tp):
    from tp_train import ParallelDims
    from tp_train.training import ParallelTraining
    from tp_train.training.experts import TrainingExperts

    dims = ParallelDims.from_world(world_size, tp=tp, cp=1 if tp > 1 else 2)
    dims.validate()
    mesh = dims.build_mesh("cpu")
    model = nn.Linear(2, 2)
    training = ParallelTraining(model, model, dims, mesh, TrainingExperts(1, None))
    mean, count = SHARES[rank]
    logged = training.batch_loss(torch.tensor(mean, requires_grad=True), torch.tensor(count))
    return logged.item(), logged.requires_grad


def test_the_logged_loss_is_the_whole_batchs_over_the_data_and_context_parallel_ranks():
    tokens = sum(count for _, count in SHARES)
    whole = sum(mean * count for mean, count in SHARES if count) / tokens  # one process's mean over every token
    for rank, (logged, tracked) in enumerate(run_on_ranks(_batch_loss, 4, 1)):
        assert math.isclose(logged, whole, rel_tol=1e-6), (rank, logged, whole)
        assert not tracked, rank  # for logging: no gradient flows through it


def test_tensor_parallel_ranks_hold_the_same_tokens_and_log_their_own_loss():
    for rank, (logged, _) in enumerate(run_on_ranks(_batch_loss, 2, 2)):
        assert logged == SHARES[rank][0], (rank, logged)
