"""TextDataModule: the default Python-stdlib corpus builds real, Python-looking blocks with a trained BPE tokenizer;
a second build with the same arguments reuses the disk cache untouched; local .txt/.jsonl sources and a saved
tokenizer work; every bad source fails fast with one clear line naming the config key."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from unittest import mock

import datasets
import lightning as L
import pytest
import torch

from tp_train.app import data
from tp_train.app.data import TextDataModule
from tp_train.errors import ConfigError

BLOCK = 64
SMALL = {"max_files": 30, "max_bytes": 300_000, "vocab_size": 512, "block_size": BLOCK}  # ~1 s to build
SENTENCES = [f"Sentence {i} of the local corpus: the parrot {i % 7} is resting, not dead." for i in range(300)]


def _build(**kwargs) -> TextDataModule:
    datamodule = TextDataModule(**kwargs)
    datamodule.prepare_data()
    datamodule.setup("fit")
    return datamodule


def _all_blocks(dataset) -> torch.Tensor:
    return torch.stack([dataset[i] for i in range(len(dataset))])


def _error(exc_type, **kwargs) -> str:
    """The message of the error that building with these arguments raises; it must be one line."""
    with pytest.raises(exc_type) as info:
        _build(**kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


@pytest.fixture(scope="module")
def stdlib_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("stdlib_cache")


@pytest.fixture(scope="module")
def stdlib(stdlib_cache) -> TextDataModule:
    return _build(cache_dir=str(stdlib_cache), **SMALL)


def test_stdlib_corpus_is_sorted_capped_and_skips_tests_and_site_packages():
    everything = TextDataModule()._files()
    assert everything == sorted(everything) and len(everything) > 200
    root = Path(sysconfig.get_paths()["stdlib"])
    assert not any({"site-packages", "test", "tests"} & set(path.relative_to(root).parts) for path in everything)
    assert TextDataModule(max_files=3)._files() == everything[:3]
    capped = TextDataModule(max_bytes=everything[0].stat().st_size + everything[1].stat().st_size)._files()
    assert capped == everything[:2]
    assert TextDataModule(max_bytes=1)._files() == everything[:1]  # a cap never empties the corpus


def test_stdlib_batches_are_long_blocks_within_the_vocabulary(stdlib):
    assert stdlib.vocab_size == len(stdlib.tokenizer) == 512
    assert len(stdlib.train_dataset) > 100 and len(stdlib.val_dataset) >= 1
    total = len(stdlib.train_dataset) + len(stdlib.val_dataset)
    assert len(stdlib.val_dataset) == int(total * 0.05)
    for loader in (stdlib.train_dataloader(), stdlib.val_dataloader()):
        batch = next(iter(loader))
        assert batch.shape == (8, BLOCK + 1) and batch.dtype == torch.long
    blocks = torch.cat([_all_blocks(stdlib.train_dataset), _all_blocks(stdlib.val_dataset)])
    assert blocks.min() >= 0 and blocks.max() < stdlib.vocab_size
    assert (blocks == stdlib.tokenizer.eos_token_id).sum() > 10  # documents are joined with EOS


def test_stdlib_blocks_decode_to_python_source(stdlib):
    for dataset in (stdlib.train_dataset, stdlib.val_dataset):
        text = stdlib.tokenizer.decode(torch.cat([dataset[i] for i in range(min(len(dataset), 50))]))
        assert "def " in text or "import " in text, text[:500]
    assert stdlib.tokenizer.decode(stdlib.tokenizer("def f():\n    return 1")["input_ids"]) == "def f():\n    return 1"


def test_train_order_is_seeded_and_val_is_in_order(stdlib):
    first = next(iter(stdlib.train_dataloader()))
    assert torch.equal(first, next(iter(stdlib.train_dataloader())))
    assert not torch.equal(first, _all_blocks(stdlib.train_dataset)[:8])  # shuffled
    first_val = next(iter(stdlib.val_dataloader()))
    assert torch.equal(first_val[0], stdlib.val_dataset[0])


def test_second_build_reuses_the_cache_without_touching_it(stdlib, stdlib_cache):
    mtimes = {path: path.stat().st_mtime_ns for path in stdlib_cache.rglob("*") if "hf" not in path.parts}
    rebuilt = RuntimeError("rebuilt")
    with (
        mock.patch.object(data, "_train_tokenizer", side_effect=rebuilt),
        mock.patch.object(data, "_tokenize_and_pack", side_effect=rebuilt),
        mock.patch.object(TextDataModule, "_load_documents", side_effect=rebuilt),
    ):
        warm = _build(cache_dir=str(stdlib_cache), **SMALL)
        # The mocks do bite: another block size must pack again (reusing the tokenizer).
        with pytest.raises(RuntimeError, match="rebuilt"):
            _build(cache_dir=str(stdlib_cache), **{**SMALL, "block_size": BLOCK * 2})
    assert {path: path.stat().st_mtime_ns for path in mtimes} == mtimes
    assert torch.equal(_all_blocks(warm.train_dataset), _all_blocks(stdlib.train_dataset))
    assert torch.equal(_all_blocks(warm.val_dataset), _all_blocks(stdlib.val_dataset))


def test_builds_are_deterministic_across_cache_dirs(stdlib, tmp_path):
    again = _build(cache_dir=str(tmp_path), **SMALL)
    assert again.tokenizer.backend_tokenizer.to_str() == stdlib.tokenizer.backend_tokenizer.to_str()
    assert torch.equal(_all_blocks(again.val_dataset), _all_blocks(stdlib.val_dataset))
    other_seed = _build(cache_dir=str(tmp_path), seed=7, **SMALL)
    assert not torch.equal(_all_blocks(other_seed.val_dataset), _all_blocks(stdlib.val_dataset))


@pytest.mark.parametrize("form", ["directory", "tokenizer.json"])
def test_a_saved_tokenizer_gives_the_same_blocks(stdlib, tmp_path, form):
    stdlib.tokenizer.save_pretrained(tmp_path / "tokenizer")
    path = tmp_path / "tokenizer" / ("" if form == "directory" else "tokenizer.json")
    loaded = _build(cache_dir=str(tmp_path / "cache"), tokenizer_path=str(path), **SMALL)
    assert loaded.vocab_size == stdlib.vocab_size
    assert loaded.tokenizer.eos_token == data.EOS
    assert not list((tmp_path / "cache").glob("*/tokenizer-bpe*"))  # nothing was trained
    assert torch.equal(_all_blocks(loaded.train_dataset), _all_blocks(stdlib.train_dataset))
    assert loaded.tokenizer_source == str(path)
    # data.vocab_size sizes only a tokenizer trained here; a given one's ids are checked against the model's
    # embedding (tp_train.app.preflight.check_tokenizer).
    other_size = _build(cache_dir=str(tmp_path / "cache"), tokenizer_path=str(path), **{**SMALL, "vocab_size": 500})
    assert other_size.vocab_size == stdlib.vocab_size


def tokenizer_ending_documents_with(eos: str):
    """A byte-level BPE tokenizer with two special tokens that ends documents with `eos`: two of these share their
    tokenizer.json and differ in tokenizer_config.json only (as Llama 3's base and instruct tokenizers do)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(SENTENCES, trainers.BpeTrainer(vocab_size=300, special_tokens=["<end>", "<eot>"],
                                                           initial_alphabet=alphabet))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=eos)


def test_tokenizers_that_end_documents_differently_never_share_blocks(tmp_path):
    """The blocks hold the token that ends each document, which is not in tokenizer.json: the cache key hashes it
    too, so each tokenizer's blocks hold its own end token and never the other's."""
    with open(tmp_path / "sentences.jsonl", "w") as f:
        f.writelines(json.dumps({"text": sentence}) + "\n" for sentence in SENTENCES)  # one document each
    files = {}
    for eos in ("<end>", "<eot>"):
        tokenizer_ending_documents_with(eos).save_pretrained(tmp_path / eos)
        files[eos] = (tmp_path / eos / "tokenizer.json").read_text()
        built = _build(source=str(tmp_path / "sentences.jsonl"), tokenizer_path=str(tmp_path / eos),
                       cache_dir=str(tmp_path / "cache"), block_size=16)  # fmt: skip
        own, other = built.tokenizer.convert_tokens_to_ids([eos, "<eot>" if eos == "<end>" else "<end>"])
        blocks = _all_blocks(built.train_dataset)
        assert (blocks == own).sum() > 10 and (blocks == other).sum() == 0, eos
    assert files["<end>"] == files["<eot>"]
    assert len(list((tmp_path / "cache").glob("corpus-*/blocks-*"))) == 2


def test_local_text_and_jsonl_files(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n".join(SENTENCES[:150]))
    with open(corpus / "b.jsonl", "w") as f:
        for sentence in SENTENCES[150:]:
            f.write(json.dumps({"content": sentence, "id": 1}) + "\n")
    common = {"cache_dir": str(tmp_path / "cache"), "block_size": 16, "vocab_size": 300, "text_field": "content"}
    for source, expected in [
        (corpus / "a.txt", SENTENCES[:150]),
        (corpus / "b.jsonl", SENTENCES[150:]),
        (corpus / "*.jsonl", SENTENCES[150:]),
        (corpus, SENTENCES),
    ]:
        datamodule = _build(source=str(source), **common)
        text = datamodule.tokenizer.decode(_all_blocks(datamodule.train_dataset).flatten())
        assert sum(sentence in text for sentence in expected) > len(expected) // 2, source
        others = [s for s in SENTENCES if s not in expected]
        assert not any(sentence in text for sentence in others), source
    message = _error(ValueError, source=str(corpus / "b.jsonl"), **{**common, "text_field": "body"})
    assert "data.text_field='body'" in message


def test_missing_local_path_names_the_key_and_the_path(tmp_path):
    for source in [str(tmp_path / "missing.txt"), "./missing_dir", str(tmp_path / "*.jsonl")]:
        message = _error(ConfigError, source=source, cache_dir=str(tmp_path))
        assert f"data.source={source!r}" in message


def test_empty_and_too_small_corpora_name_the_block_size_and_token_count(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    message = _error(ValueError, source=str(tmp_path / "empty.txt"), cache_dir=str(tmp_path), block_size=BLOCK)
    assert " 0 tokens" in message and f"data.block_size+1={BLOCK + 1}" in message

    text = " ".join(SENTENCES[:3])
    (tmp_path / "small.txt").write_text(text)
    small = {"source": str(tmp_path / "small.txt"), "cache_dir": str(tmp_path), "block_size": 1000}
    with pytest.raises(ValueError) as info:
        TextDataModule(**small).prepare_data()
    tokenizer = _build(**{**small, "block_size": 8}).tokenizer  # the one the failed build trained, from the cache
    tokens = len(tokenizer(text)["input_ids"]) + 1  # + EOS
    assert f" {tokens} tokens" in str(info.value) and "\n" not in str(info.value)
    # Two blocks fit exactly (one train, one val); blocks one token longer do not.
    built = _build(**{**small, "block_size": tokens // 2 - 1})
    assert (len(built.train_dataset), len(built.val_dataset)) == (1, 1)
    message = _error(ValueError, **{**small, "block_size": tokens // 2})
    assert f"{tokens} tokens, fewer than the 2 blocks (train and val) of data.block_size+1={tokens // 2 + 1}" in message


@pytest.mark.parametrize("why", ["HF_HUB_OFFLINE", "unreachable"])
def test_unloadable_hub_name_fails_fast_in_one_line(tmp_path, monkeypatch, why):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", why == "HF_HUB_OFFLINE")
    # No traffic leaves the test: the probe's session fails as a dead network does.
    session = mock.Mock(head=mock.Mock(side_effect=ConnectionError("[Errno -2] Name or service not known")))
    monkeypatch.setattr(data, "get_session", lambda: session)
    name = "tp-train-tests/no-such-dataset"
    message = _error(ValueError, source=name, cache_dir=str(tmp_path))
    assert f"data.source={name!r}" in message and "data.source=python_stdlib" in message
    assert "offline or unreachable" in message
    assert session.head.called == (why == "unreachable")


def test_hub_dataset_rows_are_capped_and_read_from_text_field(tmp_path, monkeypatch):
    calls = []

    def load_dataset(*args, **kwargs):  # stands in for the hub, which this machine cannot reach
        calls.append((args, kwargs))
        return datasets.Dataset.from_dict({"content": SENTENCES, "id": list(range(len(SENTENCES)))})

    monkeypatch.setattr(data, "_hub_reachable", lambda: True)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    hub = {"source": "owner/name", "subset": "raw", "text_field": "content", "max_files": 100, "block_size": 16}
    datamodule = _build(cache_dir=str(tmp_path), vocab_size=300, **hub)
    assert [(args, kwargs["split"]) for args, kwargs in calls] == [(("owner/name", "raw"), "train[:100]")]
    assert "parrot" in datamodule.tokenizer.decode(datamodule.train_dataset[0])
    message = _error(ValueError, cache_dir=str(tmp_path), **{**hub, "text_field": "text"})
    assert "data.text_field='text'" in message


def test_trainer_fits_on_the_datamodule(stdlib_cache):
    class TinyLM(L.LightningModule):
        def __init__(self, vocab_size: int):
            super().__init__()
            self.embedding = torch.nn.Embedding(vocab_size, 16)
            self.head = torch.nn.Linear(16, vocab_size)

        def training_step(self, batch, batch_idx):
            x, y = batch[:, :-1], batch[:, 1:]  # (B, block_size) each
            return torch.nn.functional.cross_entropy(self.head(self.embedding(x)).flatten(0, 1), y.flatten())

        validation_step = training_step

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    datamodule = TextDataModule(cache_dir=str(stdlib_cache), **SMALL)
    datamodule.prepare_data()
    model = TinyLM(datamodule.vocab_size)
    trainer = L.Trainer(
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
    )
    trainer.fit(model, datamodule=datamodule)
    assert trainer.global_step == 3
