"""A pipeline rank gives storage only to its own stages during set-up: built on the meta device (as train.py builds
it) and sharded without verification, each of pp=4's ranks holds at its peak at most 1.1x the bytes of the parameters
it keeps, never the whole model (the cut comes before any weight is drawn). Verification runs the whole model, so
with it on a rank holds every stage for a while (docs/pipeline-parallelism.md).

What set-up gives storage to is tracked by torch's `MemTracker` (a dispatch mode over every tensor allocated, freed
ones leaving the count) from the callbacks' `setup` hook, before `configure_model` builds the model, to
`on_fit_start`, after the strategy's setup."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.lightning_helpers import make_trainer
from tp_train import CausalLMModule

VOCAB, SEQ = 512, 16
CONFIG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=4, n_embd=128, dropout=0.0)
BOUND = 1.1  # the set-up peak over the bytes of the parameters the rank keeps


class SetUpPeak(L.Callback):
    """The most bytes tensors held at once from `setup` to `on_fit_start`, and the bytes of the parameters the rank
    keeps after set-up (each once)."""

    def setup(self, trainer, pl_module, stage):
        self.tracker = MemTracker()
        self.tracker.__enter__()

    def on_fit_start(self, trainer, pl_module):
        self.tracker.__exit__(None, None, None)
        self.peak = self.tracker.get_tracker_snapshot("peak").get(torch.device("cpu"), {}).get("Total", 0)
        self.kept = sum(param.numel() * param.element_size() for param in pl_module.parameters())


def _set_up_peaks(rank, world_size, verify):
    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, SEQ + 1)), batch_size=4)
    L.seed_everything(0)
    module = CausalLMModule(partial(GPT, CONFIG), partial(torch.optim.SGD, lr=0.1))
    peak = SetUpPeak()
    settings = {"pipeline_parallel_size": world_size, "verify_plan": verify}
    trainer = make_trainer(1, callbacks=[peak], strategy_kwargs=settings, max_steps=0)
    trainer.fit(module, data)
    whole = sum(param.numel() * param.element_size() for param in GPT(CONFIG).parameters())
    return peak.peak, peak.kept, whole


@pytest.mark.slow
def test_each_pipeline_rank_gives_storage_to_its_own_stages_only():
    for rank, (peak, kept, whole) in enumerate(run_on_ranks(_set_up_peaks, 4, False, timeout=240)):
        assert kept < 0.4 * whole, (rank, kept, whole)  # one stage of four, the tied head's copy included
        assert peak <= BOUND * kept, (rank, peak, kept, whole)
