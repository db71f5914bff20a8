"""A Mixtral trained at ep=2 leaves with every expert: its sharded checkpoint exported by `tp-train-export` loads in
Hugging Face's `from_pretrained` to the trained model's logits, and a consolidated file
(`save_distributed_checkpoint=False`) holds all the experts stacked as one process holds them, loads in a plain
process to the same logits, and loads back into the ep=2 ranks' runs of experts (their momentum too)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

import tp_train
from tests.distributed import run_on_ranks
from tests.lightning_helpers import GLOBAL_BATCH, make_trainer, token_data
from tests.test_parallelize import ATOL, VOCAB
from tp_train.tools.export import main as export_main

STEPS = 3
IDX = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))


def _mixtral():
    from models.hf import hugging_face_causal_lm

    fields = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)  # fmt: skip
    return hugging_face_causal_lm("mixtral", config=fields)


def _train_and_save(rank, world_size, directory):
    """Three SGD steps at ep=2 (dp=2), then the checkpoint both ways. Returns the trained model's logits (every
    rank computes them: the dispatch is a collective), its config, and whether the consolidated file loaded back
    into the live ranks gives the parameters and momentum they had, exactly."""
    torch.manual_seed(0)
    module = tp_train.CausalLMModule(_mixtral(), lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9))
    trainer = make_trainer(1, max_steps=STEPS, strategy_kwargs={"expert_parallel_size": 2, "verify_plan": False})
    data = token_data(STEPS).tensors[0]
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // world_size))
    directory = Path(directory)
    trainer.save_checkpoint(directory / "ep2")  # sharded (DCP): the experts stored by their global index
    trainer.strategy.save_distributed_checkpoint = False
    trainer.save_checkpoint(directory / "ep2.ckpt")  # one file from rank 0
    module.eval()
    with torch.no_grad():
        logits = module(IDX)
    optimizer = trainer.optimizers[0]
    before = [(p.detach().clone(), optimizer.state[p]["momentum_buffer"].clone()) for p in module.parameters()]
    with torch.no_grad():
        for param in module.parameters():
            param.zero_()
            optimizer.state[param]["momentum_buffer"].zero_()
    trainer.strategy.load_checkpoint(directory / "ep2.ckpt")
    loaded = all(
        torch.equal(p, value) and torch.equal(optimizer.state[p]["momentum_buffer"], momentum)
        for p, (value, momentum) in zip(module.parameters(), before, strict=True)
    )
    return logits, loaded


@pytest.mark.slow
def test_mixtral_at_ep2_exports_every_expert(tmp_path):
    from transformers import AutoModelForCausalLM

    results = run_on_ranks(_train_and_save, 2, str(tmp_path), timeout=300)
    (logits, _), (other, _) = results
    assert all(loaded for _, loaded in results)  # each rank took its own run of experts back from the file
    assert torch.equal(logits, other)

    export_main([str(tmp_path / "ep2"), str(tmp_path / "exported")])  # tp-train-export CHECKPOINT OUT_DIR
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "exported")
    assert exported.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 8  # every expert, not a rank's 4
    with torch.no_grad():
        error = (exported(input_ids=IDX).logits - logits).abs().max().item()
    assert error < ATOL, error

    state = torch.load(tmp_path / "ep2.ckpt", weights_only=True)["state_dict"]
    plain = _mixtral()
    plain.load_state_dict({name.removeprefix("model."): value for name, value in state.items()})
    with torch.no_grad():
        error = (plain(input_ids=IDX).logits - logits).abs().max().item()
    assert error < ATOL, error
