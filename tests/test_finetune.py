"""Fine-tuning a pretrained model as the README and docs/fine-tuning.md show it: scripts/tiny_llama.py writes a tiny
Llama and its own tokenizer to DIR, and the corpus the commands read; `train.py model=hf model.path=DIR peft=lora`
trains LoRA adapters on DIR's tokenizer, tp=2 with the losses of tp=1; its checkpoint is small; `tp-train-generate`
prints the same text at any tp (with a KV cache split by heads), as the run's own validation samples;
`tp-train-export` writes the merged model and the peft adapter directory."""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import train_cases
from tests.distributed import run_on_ranks
from tests.test_data import tokenizer_ending_documents_with
from tests.test_train_app import wandb_records

ROOT = Path(__file__).resolve().parents[1]
RUN = ["data=local_text", "trainer.enable_progress_bar=false", "~callbacks.progress_bar", "logger=csv",
       "trainer.log_every_n_steps=1", "trainer.limit_val_batches=0", "optimizer.lr=0.01"]  # fmt: skip
# Validation once, at the last step, with a greedy sample of "def " logged to W&B.
SAMPLED = ["logger=wandb", "trainer.limit_val_batches=1", "trainer.val_check_interval=30", 'samples.prompts=["def "]',
           "samples.max_new_tokens=16"]  # fmt: skip
PROMPT, NEW_TOKENS = "def ", 16


def readme_snippet() -> str:
    """The documented set-up, scripts/tiny_llama.py, as source (tests/test_cuda_train.py runs it with `-c`)."""
    return (ROOT / "scripts" / "tiny_llama.py").read_text()


def code_corpus() -> str:
    """Short functions a tiny model learns in 30 steps, so that its greedy text is code rather than blanks (a model
    whose every continuation is spaces would print the same text at any tp, right or wrong)."""
    generator = random.Random(0)
    names = ["add", "scale", "merge", "split", "count", "render", "parse", "load"]
    functions = (
        f"def {generator.choice(names)}_{i % 9}(value, other):\n    return value + other * {i % 7}\n"
        for i in range(400)
    )
    return "\n".join(functions)


def _train(tmp: Path, run: str, corpus: str, *overrides: str, env: dict | None = None) -> Path:
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp / "cache"), "WANDB_MODE": "offline", **(env or {})}
    env.pop("TP_TRAIN_RESUME_FROM", None)
    command = [sys.executable, "train.py", *RUN, f"data.source={tmp / corpus}", *overrides,
               f"hydra.run.dir={tmp / run}"]  # fmt: skip
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return tmp / run


def _losses(run_dir: Path) -> list[float]:
    (metrics,) = run_dir.glob("csv/*/metrics.csv")
    return [float(row["train/loss"]) for row in csv.DictReader(metrics.open()) if row.get("train/loss")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """DIR and corpus.txt from scripts/tiny_llama.py, a code corpus, and the runs the tests read: the adapter run of
    the documented command at tp=2 and the same at tp=1 (10 steps each), the whole of DIR's model fine-tuned on code
    (30 steps, W&B, a validation sample), and a gpt_tiny trained on code from scratch (30 steps)."""
    tmp = tmp_path_factory.mktemp("finetune")
    script = ROOT / "scripts" / "tiny_llama.py"
    output = tmp / "tiny_llama_output"
    output.mkdir()
    case = {"script": script.relative_to(ROOT).as_posix(), "overrides": [], "cwd": str(tmp), "directory": str(output),
            "child_ranks": 0}  # fmt: skip
    (made,) = train_cases.run_batch([case], timeout=300)  # `python scripts/tiny_llama.py` in tmp, imports shared
    assert made["status"] == 0, made["stderr"][-3000:]
    assert (tmp / "corpus.txt").stat().st_size > 100_000  # the documented commands read the script's corpus
    (tmp / "code.txt").write_text(code_corpus())
    lora = ["model=hf", f"model.path={tmp / 'tiny-llama'}", "peft=lora", "trainer.max_steps=10"]
    code = ["trainer.max_steps=30", "tp=2", "data.block_size=64"]
    return {
        "tmp": tmp,
        "dir": tmp / "tiny-llama",
        "lora_tp2": _train(tmp, "lora_tp2", "corpus.txt", *lora, "tp=2"),
        "lora_tp1": _train(tmp, "lora_tp1", "corpus.txt", *lora, "tp=1"),
        "full": _train(tmp, "full", "code.txt", "model=hf", f"model.path={tmp / 'tiny-llama'}", *code, *SAMPLED),
        "gpt": _train(tmp, "gpt", "code.txt", "model=gpt_tiny", "data.vocab_size=300", *code),
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


def test_model_path_brings_its_tokenizer_to_the_data_unless_data_tokenizer_path_says_otherwise(tmp_path):
    """The data module of `model=hf model.path=DIR` tokenizes with DIR's tokenizer (not one trained on the corpus:
    the ids would mean something else to the pretrained model); `data.tokenizer_path` picks another, or with null
    trains one."""
    from hydra.utils import instantiate

    from tests.test_configs import _compose

    dir_tokenizer = tokenizer_ending_documents_with("<end>")  # trained on other text: other ids than the corpus's
    for name in ("DIR", "other"):
        dir_tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "corpus.txt").write_text(code_corpus())
    common = ["model=hf", f"model.path={tmp_path / 'DIR'}", "data=local_text", f"data.source={tmp_path / 'corpus.txt'}",
              f"data.cache_dir={tmp_path / 'cache'}", "data.block_size=16", "data.vocab_size=300"]  # fmt: skip
    sources = {}
    for tokenizer_path in (None, str(tmp_path / "other"), "null"):
        extra = [] if tokenizer_path is None else [f"data.tokenizer_path={tokenizer_path}"]
        datamodule = instantiate(_compose(tmp_path, [*common, *extra]).data)
        datamodule.prepare_data()
        datamodule.setup()
        sources[tokenizer_path] = datamodule.tokenizer_source
        if tokenizer_path is None:
            ids = dir_tokenizer(code_corpus()[:300], add_special_tokens=False)["input_ids"]
            blocks = [datamodule.train_dataset[i].tolist() for i in range(len(datamodule.train_dataset))]
            assert any(ids[:8] == block[j : j + 8] for block in blocks for j in range(len(block) - 8))
    assert sources[None] == str(tmp_path / "DIR") and sources[str(tmp_path / "other")] == str(tmp_path / "other")
    assert sources["null"] == str(next((tmp_path / "cache").glob("corpus-*/tokenizer-bpe300")))  # trained here


@pytest.mark.slow
def test_the_w_and_b_config_names_the_tokenizer_and_the_run_keeps_a_copy(runs):
    from transformers import AutoTokenizer

    wandb_summary, _ = wandb_records(runs["full"])
    assert wandb_summary["config"]["tokenizer"] == _summary(runs["full"])["tokenizer"] == str(runs["dir"])
    copy, original = (AutoTokenizer.from_pretrained(path) for path in (runs["full"] / "tokenizer", runs["dir"]))
    assert copy.backend_tokenizer.to_str() == original.backend_tokenizer.to_str()
    assert copy.eos_token == original.eos_token


# (run, tp, options): greedy text at every tp, the same seeded samples at two tps, and the cache against none.
SAMPLE = ("--temperature", "1.0", "--top-k", "50", "--seed", "3")
CASES = [
    *((run, tp, ()) for run, tps in (("gpt", (1, 2, 4)), ("full", (1, 2, 4)), ("lora_tp2", (1, 2))) for tp in tps),
    *((run, tp, SAMPLE) for run, tps in (("gpt", (1, 4)), ("full", (1, 2)), ("lora_tp2", (1, 2))) for tp in tps),
    ("gpt", 2, ("--no-cache",)),
    ("full", 2, ("--no-cache",)),
]


@pytest.fixture(scope="module")
def generated(runs) -> dict:
    """Each case's `tp-train-generate` (its main, forked from one process that imported it once: see
    tests.train_cases), and one run of the console script itself: {(run, tp, options): (status, stdout, stderr)}."""
    cases = [*CASES, ("gpt", 1, ("--max-new-tokens", "100"))]  # past gpt_tiny's context of 64 tokens
    directories = {case: runs["tmp"] / "generate" / str(index) for index, case in enumerate(cases)}
    for directory in directories.values():
        directory.mkdir(parents=True)
    jobs = [
        {
            "module": "tp_train.app.generate",
            "overrides": [
                str(runs[run] / "checkpoints" / "last.ckpt"),
                "--tp",
                str(tp),
                "--prompt",
                PROMPT,
                "--max-new-tokens",
                str(NEW_TOKENS),
                *options,
            ],  # fmt: skip
            "directory": str(directories[run, tp, options]),
        }
        for run, tp, options in cases
    ]
    outcomes = zip(cases, train_cases.run_batch(jobs, timeout=900), strict=True)
    results = {case: (result["status"], result["stdout"], result["stderr"]) for case, result in outcomes}
    console_script = Path(sys.executable).parent / "tp-train-generate"  # beside the interpreter, on PATH or not
    script = subprocess.run(
        [str(console_script), str(runs["gpt"] / "checkpoints" / "last.ckpt"), "--tp", "2", "--prompt", PROMPT,
         "--max-new-tokens", str(NEW_TOKENS)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    results["console script"] = (script.returncode, script.stdout, script.stderr)
    return results


def _text(generated: dict, case) -> str:
    """The continuation a case printed: stdout is that text and one newline, nothing else."""
    status, stdout, stderr = generated[case]
    assert status == 0, stderr[-3000:]
    assert stdout.endswith("\n"), stdout
    print(stderr.strip().splitlines()[-1])  # the speed
    return stdout[:-1]


@pytest.mark.slow
@pytest.mark.parametrize("run, tps", [("gpt", (1, 2, 4)), ("full", (1, 2, 4)), ("lora_tp2", (1, 2))])
def test_greedy_generation_is_the_same_at_every_tp(generated, run, tps):
    texts = [_text(generated, (run, tp, ())) for tp in tps]
    assert len(set(texts)) == 1, texts
    assert not texts[0].startswith(PROMPT), texts  # a continuation, not the prompt back
    if run != "lora_tp2":  # trained on code: text, not blanks, so that a wrong shard would show
        assert "return value" in texts[0], texts
        assert _text(generated, (run, 2, ("--no-cache",))) == texts[0]  # the cache changes the speed only
    if run == "gpt":
        assert _text(generated, "console script") == texts[0]
    # Seeded sampling: the same draws at two tps, whose logits must then agree everywhere, not only at their maximum.
    sampled = [_text(generated, (run, tp, SAMPLE)) for tp in {"gpt": (1, 4)}.get(run, (1, 2))]
    assert len(set(sampled)) == 1 and len(set(sampled[0])) > 3, sampled


@pytest.mark.slow
def test_the_runs_validation_sample_is_the_text_generation_prints(runs, generated):
    """The sample the training run logged to W&B at its last step, drawn by the sharded model in training (tp=2, its
    vocabulary-sharded logits gathered), is what tp-train-generate prints from the checkpoint of that step."""
    table = next(runs["full"].glob("wandb/offline-run-*/files/media/table/samples_*.table.json"))
    rows = json.loads(table.read_text())["data"]
    assert rows == [[30, PROMPT, _text(generated, ("full", 1, ()))]], rows


@pytest.mark.slow
def test_a_continuation_past_the_models_context_is_one_line(generated):
    status, stdout, stderr = generated["gpt", 1, ("--max-new-tokens", "100")]
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert status == 2 and stdout == "" and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "exceed the model's context of 64 tokens; use --max-new-tokens<=62" in errors[0]


def _caches(rank, world_size, checkpoints):
    """Each model's KV cache on this rank after a prompt and 3 greedy tokens: per layer, (keys, values)."""
    from torch.distributed.device_mesh import init_device_mesh

    from tp_train.app.generate import load_sharded
    from tp_train.tools.generation import generate

    mesh = init_device_mesh("cpu", (world_size,))
    caches = {}
    for name, checkpoint in checkpoints.items():
        model, _ = load_sharded(Path(checkpoint), mesh, mesh, torch.device("cpu"))
        _, cache = generate(model, torch.tensor([[5, 6, 7, 8]]), 3)
        if hasattr(cache, "layers"):  # Hugging Face's DynamicCache
            caches[name] = [(layer.keys, layer.values) for layer in cache.layers]
        else:  # models.KVCache, by attention module in order
            caches[name] = list(zip(cache.keys.values(), cache.values.values(), strict=True))
    return caches


@pytest.mark.slow
def test_each_rank_caches_only_its_own_heads(runs):
    """Rank r's cache is its heads' slice of the unsharded model's cache: gpt_tiny's 4 heads 2 per rank at tp 2 and 1
    at tp 4; the tiny Llama's 2 kv heads 1 per rank at tp 2, and at tp 4 each held by the 2 ranks whose query heads
    read it."""
    checkpoints = {run: str(runs[run] / "checkpoints" / "last.ckpt") for run in ("gpt", "full")}
    (whole,) = run_on_ranks(_caches, 1, checkpoints, timeout=300)
    assert {name: whole[name][0][0].shape[1] for name in whole} == {"gpt": 4, "full": 2}
    for tp in (2, 4):
        for rank, caches in enumerate(run_on_ranks(_caches, tp, checkpoints, timeout=300)):
            for name, layers in caches.items():
                heads = whole[name][0][0].shape[1]
                own = range(rank * heads // tp, (rank + 1) * heads // tp) if heads >= tp else [rank * heads // tp]
                for (keys, values), (all_keys, all_values) in zip(layers, whole[name], strict=True):
                    assert keys.shape[1] == len(own), (name, tp, rank, keys.shape)
                    assert torch.allclose(keys, all_keys[:, list(own)], atol=1e-5), (name, tp, rank)
                    assert torch.allclose(values, all_values[:, list(own)], atol=1e-5), (name, tp, rank)


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
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=300)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert f"data.tokenizer_path={runs['dir']} has " in errors[0] and "more than the 300 rows" in errors[0], errors
    assert "Starting with 2 processes" not in result.stderr + result.stdout
    assert _summary(runs["gpt"])["tokenizer"] != str(runs["dir"])  # a model from scratch: one trained on the corpus


def _blocks(tmp_path: Path, source: str, **kwargs):
    from tp_train import TextDataModule

    datamodule = TextDataModule(str(tmp_path / source), block_size=16, cache_dir=str(tmp_path / "cache"), **kwargs)
    datamodule.prepare_data()
    datamodule.setup()
    return datamodule


def test_blocks_tokenized_by_one_tokenizer_are_never_read_with_another(tmp_path):
    """The cache key hashes the tokenizer: the same corpus with two tokenizers gives two sets of blocks (and
    tests/test_data.py: so do two that differ only in the token ending a document)."""
    (tmp_path / "corpus.txt").write_text(" ".join(f"word{i % 97} and more words" for i in range(4000)))
    first = _blocks(tmp_path, "corpus.txt", vocab_size=300)
    first.tokenizer.save_pretrained(tmp_path / "first")
    second = _blocks(tmp_path, "corpus.txt", vocab_size=400)
    assert first.tokenizer.backend_tokenizer.to_str() != second.tokenizer.backend_tokenizer.to_str()
    blocks = sorted(p.name for p in (tmp_path / "cache").glob("corpus-*/blocks-*"))
    assert len(blocks) == 2, blocks  # one per tokenizer, same corpus, block size and seed
    again = _blocks(tmp_path, "corpus.txt", tokenizer_path=str(tmp_path / "first"))
    assert torch.equal(again.train_dataset[0], first.train_dataset[0])  # the first's blocks, reused
    assert len(list((tmp_path / "cache").glob("corpus-*/blocks-*"))) == 2
