"""Export: a checkpoint saved at tp=2 (by `tp_train.checkpoint.dcp.save`, or by a `python train.py model=hf` run)
becomes a `save_pretrained` directory that `AutoModelForCausalLM.from_pretrained` loads to the same logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import next_token_loss
from tests.test_parallelize import ATOL, VOCAB, _hf_gpt2, _hf_gpt_neox, _hf_llama
from tests.test_train_app import run_train
from tp_train.tools.export import export_hugging_face
from tp_train.tools.export import main as export_main

# GPT-2: tied embeddings, a padded vocabulary, Conv1D weights and a fused [q; k; v] (saved as sections).
# GPT-NeoX: saved by transformers as `embed_out`. Llama: grouped kv heads.
FAMILIES = {"gpt2": _hf_gpt2, "gpt_neox": _hf_gpt_neox, "llama": _hf_llama}
IDX = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _train_and_save(rank, world_size, directory):
    """One SGD step of each family sharded at tp=2 (so the weights are not the initial ones), then a checkpoint."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    logits = {}
    for name, build in FAMILIES.items():
        torch.manual_seed(0)
        model = tp_train.parallelize(build(), mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        next_token_loss(model(input_ids=IDX).logits, IDX).backward()
        optimizer.step()
        tp_train.save_checkpoint(Path(directory) / name, model, [optimizer], mesh)
        with torch.no_grad():
            logits[name] = model(input_ids=IDX).logits
    return logits


@pytest.mark.slow
def test_a_tp2_checkpoint_exports_to_a_directory_from_pretrained_loads_to_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    trained = run_on_ranks(_train_and_save, 2, str(tmp_path), timeout=300)[0]
    for name, build in FAMILIES.items():
        config = build().config
        out = export_hugging_face(tmp_path / name, tmp_path / f"{name}_hf", config=config)
        exported = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            error = (exported(input_ids=IDX).logits - trained[name]).abs().max().item()
        assert error < ATOL, (name, error)
        assert exported.get_input_embeddings().weight.shape[0] == VOCAB  # the padding rows did not leak out
        tied = exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
        assert tied == bool(config.tie_word_embeddings), name


def _checkpoint_logits(rank, world_size, checkpoint, exported):
    """The trained checkpoint loaded by tp_train itself (at tp=1) into a CausalLMModule around the model."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(exported))
    module = tp_train.CausalLMModule(model=tp_train.parallelize(model, device="cpu"), optimizer=None)
    extra = tp_train.load_checkpoint(checkpoint, module, [], init_device_mesh("cpu", (world_size,)))
    with torch.no_grad():
        return module(IDX), extra["global_step"]


@pytest.mark.slow
def test_python_train_model_hf_llama_tp2_trains_and_its_checkpoint_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    run_dir = tmp_path / "run"
    run_train(
        "model=hf", "model.type=llama", "tp=2", "logger=none", "data.block_size=32", "data.vocab_size=300",
        "data.max_files=20", "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=1",
        f"hydra.run.dir={run_dir}", cache=tmp_path / "cache",
    )  # fmt: skip
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and len(summary["peak_memory_mib_per_rank"]) == 2
    assert summary["train_loss"] < summary["first_train_loss"], summary

    checkpoint, out = summary["checkpoint"], tmp_path / "exported"
    export_main([checkpoint, str(out)])  # python -m tp_train.tools.export CHECKPOINT OUT_DIR, in this process
    exported = AutoModelForCausalLM.from_pretrained(out)
    assert exported.config.model_type == "llama" and exported.config.num_key_value_heads == 2
    expected, step = run_on_ranks(_checkpoint_logits, 1, checkpoint, str(out))[0]
    assert step == 3
    with torch.no_grad():
        assert (exported(input_ids=IDX).logits - expected).abs().max().item() < ATOL
