"""Communication accounting: the bytes the TP collectives of a training step move, counted by the model's
`tp_comm_counter` and logged by TrainingMetrics as `comm/tp_bytes_per_step`, equal the analytic value."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.data import DataLoader

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.lightning_helpers import make_trainer
from tests.test_parallelize import VOCAB
from tp_train.tools.memory import tensor_parallel_bytes_per_step

LAYERS = 3


def _gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=LAYERS, n_head=4, n_embd=32))


def _counted(rank, world_size):
    """(counted, analytic) bytes of one forward and backward at two batch shapes, and of fitted steps."""
    out = []
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        model = tp_train.parallelize(_gpt(), sequence_parallel=sequence_parallel)
        for batch, seq in ((2, 8), (3, 16)):
            model.tp_comm_counter.reset()
            idx = torch.randint(0, VOCAB, (batch, seq))
            _, loss = model(idx, idx)
            loss.backward()
            analytic = tensor_parallel_bytes_per_step(
                _gpt(), batch, seq, world_size, sequence_parallel=sequence_parallel
            )
            out.append((model.tp_comm_counter.bytes, analytic))
    # The same through Lightning: a step's count, with validation batches in between not counted.
    torch.manual_seed(0)
    module = tp_train.CausalLMModule(_gpt(), functools.partial(torch.optim.AdamW, lr=1e-3))
    data = DataLoader(torch.randint(0, VOCAB, (8, 9)), batch_size=4)
    trainer = make_trainer(world_size, [tp_train.TrainingMetrics()], max_steps=2, val_check_interval=1,
                           limit_val_batches=1)  # fmt: skip
    trainer.fit(module, data, data)
    logged = trainer.callback_metrics["comm/tp_bytes_per_step"].item()
    out.append((logged, tensor_parallel_bytes_per_step(_gpt(), 4, 8, world_size)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_counted_bytes_equal_the_analytic_value(tp):
    for counted, analytic in run_on_ranks(_counted, tp, timeout=240)[0]:
        assert analytic > 0 and counted == analytic, (counted, analytic)
