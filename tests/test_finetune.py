"""Fine-tuning a pretrained model as README shows it: README's snippet writes a tiny Llama and its own tokenizer to
DIR; `train.py model=hf model.path=DIR peft=lora` trains LoRA adapters on DIR's tokenizer, tp=2 with the losses of
tp=1; its checkpoint is small; `tp-train-generate` prints the same greedy text at any tp (with a KV cache split by
heads); `tp-train-export` writes the merged model and the peft adapter directory."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.distributed import run_on_ranks

ROOT = Path(__file__).resolve().parents[1]
RUN = ["data=local_text", "trainer.enable_progress_bar=false", "~callbacks.progress_bar", "logger=csv",
       "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "optimizer.lr=0.01"]  # fmt: skip


def readme_snippet() -> str:
    """README's Python snippet that writes the pretrained tiny Llama and its tokenizer."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Fine-tuning a pretrained model", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _train(tmp: Path, run: str, *overrides: str) -> Path:
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp / "cache"), "WANDB_MODE": "offline"}
    env.pop("TP_TRAIN_RESUME_FROM", None)
    command = [sys.executable, "train.py", *RUN, f"data.source={tmp / 'corpus.txt'}", *overrides,
               f"hydra.run.dir={tmp / run}"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / run


def _losses(run_dir: Path) -> list[float]:
    (metrics,) = run_dir.glob("csv/*/metrics.csv")
    return [float(row["train/loss"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """DIR from README's snippet, a corpus, and the runs the tests read: the adapter run of README's command at tp=2
    and the same at tp=1 (10 steps each), the whole model fine-tuned (2 steps), and a gpt_tiny run."""
    tmp = tmp_path_factory.mktemp("finetune")
    subprocess.run([sys.executable, "-c", readme_snippet()], cwd=tmp, check=True, capture_output=True, timeout=300)
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))  # real Python text, on every machine
    (tmp / "corpus.txt").write_text("\n\n".join(p.read_text(errors="replace") for p in stdlib[40:70]))
    lora = ["model=hf", f"model.path={tmp / 'tiny-llama'}", "peft=lora", "trainer.max_steps=10"]
    return {
        "tmp": tmp,
        "dir": tmp / "tiny-llama",
        "lora_tp2": _train(tmp, "lora_tp2", *lora, "tp=2"),
        "lora_tp1": _train(tmp, "lora_tp1", *lora, "tp=1"),
        "full": _train(tmp, "full", "model=hf", f"model.path={tmp / 'tiny-llama'}", "trainer.max_steps=2", "tp=2"),
        "gpt": _train(tmp, "gpt", "model=gpt_tiny", "trainer.max_steps=20", "tp=2", "data.vocab_size=512"),
    }


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


@pytest.mark.slow
def test_the_pretrained_models_own_tokenizer_and_adapters_train(runs):
    summary = _summary(runs["lora_tp2"])
    assert summary["tokenizer"] == str(runs["dir"])  # not a tokenizer trained on the corpus
    assert summary["steps"] == 10
    assert 0 < summary["trainable_parameters"] < 0.1 * summary["parameters"], summary
    assert _summary(runs["full"])["trainable_parameters"] == _summary(runs["full"])["parameters"]
    tp1, tp2 = _losses(runs["lora_tp1"]), _losses(runs["lora_tp2"])
    assert len(tp1) == len(tp2) == 10 and tp2[-1] < tp2[0]
    assert max(abs(a - b) for a, b in zip(tp1[:5], tp2[:5], strict=True)) <= 1e-5, (tp1, tp2)
    adapters, whole = (
        _size(runs["lora_tp2"] / "checkpoints" / "last.ckpt"),
        _size(runs["full"] / "checkpoints/last.ckpt"),
    )
    print(f"checkpoint bytes: adapters {adapters}, whole model {whole} ({adapters / whole:.3f}x)")
    assert adapters < whole / 3


def _generate(checkpoint: Path, tp: int, *options: str) -> str:
    result = subprocess.run(
        ["tp-train-generate", str(checkpoint), "--tp", str(tp), "--prompt", "def ", "--max-new-tokens", "16",
         *options],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    print(result.stderr.strip().splitlines()[-1])  # the speed
    return result.stdout.rstrip("\n").splitlines()[-1]


@pytest.mark.slow
@pytest.mark.parametrize("run, tps", [("gpt", (1, 2, 4)), ("lora_tp2", (1, 2))])
def test_greedy_generation_is_the_same_at_every_tp(runs, run, tps):
    checkpoint = runs[run] / "checkpoints" / "last.ckpt"
    texts = [_generate(checkpoint, tp) for tp in tps]
    assert len(set(texts)) == 1, texts
    assert texts[0] and not texts[0].startswith("def "), texts  # a continuation, not the prompt back
    # Sampling, one seed: the same draws at every tp (a 20-step gpt_tiny's greedy text is all blanks; its samples
    # are not), whose logits must agree everywhere, not only at their maximum.
    sampled = [_generate(checkpoint, tp, "--temperature", "1.0", "--top-k", "50", "--seed", "3") for tp in tps[:2]]
    assert len(set(sampled)) == 1 and len(set(sampled[0])) > 3, sampled


def _cache_heads(rank, world_size, checkpoint):
    """Each rank's KV cache after generating: the heads it holds per layer."""
    from torch.distributed.device_mesh import init_device_mesh

    from tp_train.app.generate import generate, load_sharded

    mesh = init_device_mesh("cpu", (world_size,))
    model, _ = load_sharded(Path(checkpoint), mesh, mesh, torch.device("cpu"))
    new, cache = generate(model, torch.tensor([[5, 6, 7]]), 4)
    return sorted({keys.shape[1] for keys in cache.keys.values()}), new.tolist()


@pytest.mark.slow
def test_each_rank_caches_only_its_own_heads(runs):
    """gpt_tiny's 4 heads: 2 per rank at tp 2 (the sharded attention computes no others)."""
    results = run_on_ranks(_cache_heads, 2, str(runs["gpt"] / "checkpoints" / "last.ckpt"), timeout=300)
    assert [heads for heads, _ in results] == [[2], [2]]
    assert results[0][1] == results[1][1]


def _trained_logits(rank, world_size, checkpoint, ids):
    from torch.distributed.device_mesh import init_device_mesh

    from tp_train.app.generate import load_sharded

    mesh = init_device_mesh("cpu", (world_size,))
    model, _ = load_sharded(Path(checkpoint), mesh, mesh, torch.device("cpu"))
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_an_adapter_run_exports_merged_and_as_a_peft_adapter_directory(runs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tp_train.tools.export import main as export_main

    checkpoint, out = runs["lora_tp2"] / "checkpoints" / "last.ckpt", runs["tmp"] / "exported"
    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    trained = run_on_ranks(_trained_logits, 2, str(checkpoint), ids, timeout=300)[0]
    export_main([str(checkpoint), str(out / "merged")])
    export_main([str(checkpoint), str(out / "adapters"), "--adapters-only"])
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(runs["dir"]), out / "adapters")
    base = AutoModelForCausalLM.from_pretrained(runs["dir"])
    with torch.no_grad():
        assert (merged(input_ids=ids).logits - trained).abs().max().item() <= 1e-5
        assert (adapted(input_ids=ids).logits - trained).abs().max().item() <= 1e-5
        assert (base(input_ids=ids).logits - trained).abs().max().item() > 1e-3  # the adapters changed it
    assert len(AutoTokenizer.from_pretrained(out / "merged")) == len(AutoTokenizer.from_pretrained(runs["dir"]))


@pytest.mark.slow
def test_a_tokenizer_larger_than_the_models_embedding_is_one_line(runs):
    """DIR's tokenizer (1024 tokens) for a gpt_tiny of 300: refused before any rank starts."""
    tmp = runs["tmp"]
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp / "cache")}
    command = [sys.executable, "train.py", *RUN, f"data.source={tmp / 'corpus.txt'}", "model=gpt_tiny",
               "data.vocab_size=300", f"data.tokenizer_path={runs['dir']}",
               f"hydra.run.dir={tmp / 'refused'}"]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"data.tokenizer_path={runs['dir']} has " in errors[0] and "more than the 300 rows" in errors[0], errors
    assert "Starting with 2 processes" not in result.stderr + result.stdout
    assert _summary(runs["gpt"])["tokenizer"] != str(runs["dir"])  # a model from scratch: one trained on the corpus


def test_blocks_tokenized_by_one_tokenizer_are_never_read_with_another(tmp_path):
    """The cache key hashes the tokenizer: the same corpus with two tokenizers gives two sets of blocks."""
    from tp_train import TextDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"word{i % 97} and more words" for i in range(4000)))
    first = TextDataModule(str(corpus), block_size=16, vocab_size=300, cache_dir=str(tmp_path / "cache"))
    first.prepare_data()
    first.setup()
    first.tokenizer.save_pretrained(tmp_path / "first")
    second = TextDataModule(str(corpus), block_size=16, vocab_size=400, cache_dir=str(tmp_path / "cache"))
    second.prepare_data()
    second.setup()
    assert first.tokenizer.backend_tokenizer.to_str() != second.tokenizer.backend_tokenizer.to_str()
    blocks = sorted(p.name for p in (tmp_path / "cache").glob("corpus-*/blocks-*"))
    assert len(blocks) == 2, blocks  # one per tokenizer, same corpus, block size and seed
    again = TextDataModule(str(corpus), block_size=16, tokenizer_path=str(tmp_path / "first"),
                           cache_dir=str(tmp_path / "cache"))  # fmt: skip
    again.prepare_data()
    again.setup()
    assert torch.equal(again.train_dataset[0], first.train_dataset[0])  # the first's blocks, reused
    assert len(list((tmp_path / "cache").glob("corpus-*/blocks-*"))) == 2
