"""A pipeline rank gives storage only to its own stages during set-up: built on the meta device (as train.py builds
it) and sharded without verification, each of pp=4's ranks holds at its peak at most 1.1x the bytes of the parameters
it keeps, never the whole model (the cut comes before any weight is drawn). Verification runs the whole model, so
with it on a rank holds every stage for a while (docs/pipeline-parallelism.md). A model built empty from
pretrained weights (`model.path`) reads only its own stages' tensors from the files, and they are the files' values.

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


def _pretrained_reads(rank, world_size, path):
    """Elements each rank read from the files while `fit` set up GPT-2 from `path` at pp=world_size, the elements
    of the parameters it keeps, the whole model's, and the largest difference of a kept parameter from the files."""
    from safetensors.torch import load_file

    import tp_train.checkpoint.pretrained as pretrained
    from models import hugging_face_causal_lm

    reads, load = [], pretrained.load_pretrained

    def counted(*args, **kwargs):
        reads.append(load(*args, **kwargs))
        return reads[-1]

    pretrained.load_pretrained = counted  # the pool sets the module's attribute back after the task
    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, SEQ + 1)), batch_size=4)
    module = CausalLMModule(partial(hugging_face_causal_lm, path=str(path)), partial(torch.optim.SGD, lr=0.1))
    settings = {"pipeline_parallel_size": world_size, "verify_plan": False}
    make_trainer(1, strategy_kwargs=settings, max_steps=0).fit(module, data)
    files = load_file(f"{path}/model.safetensors")
    kept = {id(param): param for param in module.model.parameters()}.values()
    stored = {name: param for name, param in module.model.named_parameters()}
    # GPT-2's Conv1D weights are stored transposed; the strategy holds them as Linear layers
    gap = max(
        ((stored[name] - _as_held(files[name], name)).abs().max().item(), name) for name in files if name in stored
    )
    return sum(reads), sum(param.numel() for param in kept), sum(tensor.numel() for tensor in files.values()), gap


def _as_held(stored: torch.Tensor, name: str) -> torch.Tensor:
    """A block's Conv1D weight as the strategy holds it (a Linear's, transposed); any other tensor as stored."""
    return stored.t() if stored.dim() == 2 and ".h." in name else stored


@pytest.mark.slow
def test_each_pipeline_rank_reads_only_its_own_stages_from_pretrained_weights(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=4, n_head=4)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    for rank, (read, kept, whole, gap) in enumerate(run_on_ranks(_pretrained_reads, 2, tmp_path, timeout=240)):
        assert read == kept < 0.75 * whole, (rank, read, kept, whole)  # its stages (and the tied head's copy) alone
        assert gap[0] == 0, (rank, gap)
