"""Causal-LM data: a LightningDataModule that tokenizes a text corpus and packs it into fixed-length blocks."""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import json
import os
import re
import shutil
import sysconfig
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import datasets
from huggingface_hub import constants as hub_constants
from huggingface_hub.utils import get_session
from lightning.pytorch import LightningDataModule
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerFast
from typing_extensions import override

from tp_train.errors import ConfigError
from tp_train.lightning.resumable_loader import ResumableDataLoader, ResumableDistributedSampler
from tp_train.tools.tokenizer import EOS, load_tokenizer

STDLIB = "python_stdlib"
_CACHE_VERSION = 1  # bump when tokenizing or packing changes, so caches built by older code are not reused
_JSON_SUFFIXES = (".json", ".jsonl")
_DIRECTORY_SUFFIXES = (".txt", ".md", ".py", *_JSON_SUFFIXES)  # what a directory source reads
_STDLIB_SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idle_test"}  # installed packages, test data
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")  # "name" or "owner/name"
_MAP_BATCH = 1000  # documents per tokenize-and-pack call; each call drops its last partial block, as run_clm does


class TextDataModule(LightningDataModule):
    """Blocks of `block_size + 1` token ids (LongTensor) for next-token prediction: x = item[:-1], y = item[1:].

    Args:
        source: "python_stdlib"; a local file, directory or glob (.json/.jsonl files give `text_field` per record,
            other files are one document each); or a hub dataset name for `datasets.load_dataset`.
        block_size: tokens the model sees per sequence.
        batch_size: blocks per batch on each data-parallel rank.
        val_fraction: the fraction of blocks held out for validation, in (0, 1).
        vocab_size: size of the BPE tokenizer to train (not used with `tokenizer_path`).
        tokenizer_path: a local tokenizer directory (AutoTokenizer; a pretrained model's own, which the app's
            config takes from `model.path`) or tokenizer.json to use instead of training one. Blocks tokenized by
            one tokenizer are cached apart from another's (the cache key hashes the tokenizer).
        text_field: the JSON key or hub column holding the text.
        subset: the hub dataset's configuration name (e.g. "wikitext-2-raw-v1").
        max_files: read at most this many files (rows, for a hub dataset).
        max_bytes: stop before the file that would take the total past this many bytes (local files only).
        cache_dir: where tokenizers and packed blocks are cached.
        seed: orders the documents before the split and the training batches.
        num_workers: DataLoader worker processes.
        document_mask: packed documents never attend across each other: attention is block-diagonal by document
            (from the EOS tokens between them) and positions restart at each document, under
            `TensorParallelStrategy` (`document_separator` tells it the EOS id; docs/long-sequences.md).
        whole_steps: each epoch's training order cut to whole optimizer steps (this batch size x the data-parallel
            ranks x the trainer's accumulation) rather than padded for the ranks: every step trains the same
            sequences on any layout (`parallel=auto` sets it; see `ResumableDistributedSampler`).
    """

    def __init__(
        self,
        source: str = STDLIB,
        block_size: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        vocab_size: int = 8192,
        tokenizer_path: str | None = None,
        text_field: str = "text",
        subset: str | None = None,
        max_files: int | None = None,
        max_bytes: int | None = None,
        cache_dir: str = "~/.cache/tp_train",
        seed: int = 1234,
        num_workers: int = 0,
        document_mask: bool = False,
        whole_steps: bool = False,
    ) -> None:
        super().__init__()
        if not 0 < val_fraction < 1:  # to skip validation, use Trainer(limit_val_batches=0)
            raise ValueError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        if tokenizer_path is None and vocab_size < 258:  # byte-level BPE starts from 256 bytes plus EOS
            raise ValueError(f"data.vocab_size={vocab_size} must be at least 258 (256 bytes, EOS and one merge)")
        self.save_hyperparameters()
        self.source, self.block_size, self.batch_size = str(source), block_size, batch_size  # str: a Path works too
        self.val_fraction, self.requested_vocab_size, self.tokenizer_path = val_fraction, vocab_size, tokenizer_path
        self.text_field, self.subset, self.max_files, self.max_bytes = text_field, subset, max_files, max_bytes
        self.seed, self.num_workers, self.document_mask = seed, num_workers, document_mask
        self.whole_steps = whole_steps
        self.cache_dir = Path(cache_dir).expanduser()
        # Set by prepare_data() and setup(): the tokenizer, where it was read from, and its size (len(tokenizer)).
        self.tokenizer: PreTrainedTokenizerFast | None = None
        self.tokenizer_source: str | None = None
        self.vocab_size: int | None = None
        self.train_dataset = self.val_dataset = None  # set by setup()

    @property
    def document_separator(self) -> int | None:
        """The token id closing each packed document when `document_mask` is on (known once the tokenizer is)."""
        return self.tokenizer.eos_token_id if self.document_mask and self.tokenizer is not None else None

    @override
    def prepare_data(self) -> None:
        corpus_dir, files = self._corpus()
        documents = None  # read only when something must be built: a warm cache never touches the corpus
        tokenizer_dir = corpus_dir / f"tokenizer-bpe{self.requested_vocab_size}"
        if self.tokenizer_path is None and not tokenizer_dir.exists():
            documents = self._load_documents(files)
            tokenizer = _train_tokenizer(documents, self.requested_vocab_size)
            _save_atomically(tokenizer.save_pretrained, tokenizer_dir)
        self._load_tokenizer(tokenizer_dir)
        blocks_dir = self._blocks_dir(corpus_dir)
        if not blocks_dir.exists():
            documents = documents if documents is not None else self._load_documents(files)
            _save_atomically(self._pack(documents).save_to_disk, blocks_dir)
            documents.cleanup_cache_files()  # the tokenize-and-pack intermediates; the saved blocks are the cache

    @override
    def setup(self, stage: str | None = None) -> None:
        corpus_dir, _ = self._corpus()
        self._load_tokenizer(corpus_dir / f"tokenizer-bpe{self.requested_vocab_size}")
        blocks = datasets.load_from_disk(str(self._blocks_dir(corpus_dir)))  # built by prepare_data()
        # Lazy columns of int64 tensors (block_size + 1,), which the default collate stacks into batches.
        self.train_dataset, self.val_dataset = (blocks[s].with_format("torch")["input_ids"] for s in ("train", "val"))

    @override
    def train_dataloader(self) -> DataLoader:
        # Each epoch's order is a function of (seed, epoch) split over the data-parallel ranks only (the strategy's
        # sampler arguments; Lightning keeps a DistributedSampler as it is), so a checkpoint resumes mid-epoch at
        # the next untrained batch (see tp_train.lightning.resumable_loader).
        split = (self.trainer.distributed_sampler_kwargs if self.trainer is not None else None) or {}
        step_size = self._step_size(split.get("num_replicas", 1)) if self.whole_steps else None
        sampler = ResumableDistributedSampler(
            self.train_dataset, shuffle=True, seed=self.seed, step_size=step_size, **split
        )
        return self._dataloader(self.train_dataset, loader=ResumableDataLoader, sampler=sampler)

    def _step_size(self, replicas: int) -> int:
        """The sequences of one optimizer step over all data-parallel ranks; at least one in the training split."""
        step_size = self.batch_size * replicas * (self.trainer.accumulate_grad_batches if self.trainer else 1)
        if len(self.train_dataset) < step_size:
            raise ValueError(
                f"data: the training split holds {len(self.train_dataset)} blocks, fewer than one optimizer step's "
                f"{step_size} (data.batch_size={self.batch_size} x {replicas} data-parallel ranks x accumulation); "
                f"give more text or a smaller global batch"
            )
        return step_size

    @override
    def val_dataloader(self) -> DataLoader:
        return self._dataloader(self.val_dataset, shuffle=False)

    def _dataloader(self, dataset: datasets.Column, loader: type[DataLoader] = DataLoader, **kwargs) -> DataLoader:
        workers = self.num_workers
        return loader(dataset, self.batch_size, num_workers=workers, persistent_workers=workers > 0, **kwargs)

    def _corpus(self) -> tuple[Path, list[Path] | None]:
        """The corpus cache directory and the corpus files (None for a hub dataset), sorted and capped."""
        files = self._files()
        if files is None:
            identity = [self.source, self.subset, self.text_field, self.max_files, self.max_bytes]
        else:
            identity = [self.text_field, [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in files]]
        return self.cache_dir / f"corpus-{_digest([_CACHE_VERSION, identity])}", files

    def _files(self) -> list[Path] | None:
        source, path = self.source, Path(self.source).expanduser()
        if source == STDLIB:
            files = []
            for directory, subdirectories, names in os.walk(sysconfig.get_paths()["stdlib"]):
                subdirectories[:] = [d for d in subdirectories if d not in _STDLIB_SKIPPED]  # prune, do not walk
                files += [Path(directory, name) for name in names if name.endswith(".py")]
        elif path.is_dir():
            files = [p for p in path.rglob("*") if p.suffix in _DIRECTORY_SUFFIXES and p.is_file()]
        elif path.is_file():
            files = [path]
        elif any(c in source for c in "*?["):
            files = [Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file()]
        elif _HUB_NAME.fullmatch(source) and not source.startswith(".") and path.suffix not in _DIRECTORY_SUFFIXES:
            return None
        else:
            files = []
        if not files and path.is_dir():
            raise ConfigError(
                f"data.source={source!r} is a directory without {'/'.join(_DIRECTORY_SUFFIXES)} files; "
                f"point it at text files (a file, a directory or a glob) or use data.source={STDLIB}"
            )
        if not files:
            raise ConfigError(f"data.source={source!r}: no such file or directory, or no files match it")
        files = sorted(files)[: self.max_files]  # filesystem order differs between machines; the corpus must not
        if self.max_bytes is not None:  # at least one file, so a cap never empties the corpus
            totals = itertools.accumulate(p.stat().st_size for p in files)
            files = files[: max(1, sum(total <= self.max_bytes for total in totals))]
        return files

    def _load_documents(self, files: list[Path] | None) -> datasets.Dataset:
        """The corpus as a Dataset with one "text" column, one row per document."""
        load = functools.partial(datasets.load_dataset, split="train", cache_dir=str(self.cache_dir / "hf"))
        if files is None:
            return self._text_column(self._load_hub(load), self.text_field)
        json_files = [str(p) for p in files if p.suffix in _JSON_SUFFIXES]
        text_files = [str(p) for p in files if p.suffix not in _JSON_SUFFIXES]
        parts = [self._text_column(load("json", data_files=json_files), self.text_field)] if json_files else []
        if text_files:  # one row per file; a stray undecodable byte must not abort a corpus of thousands of files
            parts.append(load("text", data_files=text_files, sample_by="document", encoding_errors="replace"))
        return datasets.concatenate_datasets(parts) if len(parts) > 1 else parts[0]

    def _text_column(self, documents: datasets.Dataset, column: str) -> datasets.Dataset:
        if column not in documents.column_names:
            raise ConfigError(f"data.text_field={column!r} is not a column of data.source={self.source!r}")
        documents = documents.select_columns([column])
        return documents if column == "text" else documents.rename_column(column, "text")

    def _load_hub(self, load: Callable[..., datasets.Dataset]) -> datasets.Dataset:
        # A dead network costs ~25 s of huggingface_hub retries before the same failure; one probe with a short
        # timeout sees that, and offline mode still loads a copy that datasets has cached before.
        offline = datasets.config.HF_HUB_OFFLINE or not _hub_reachable()
        split = "train" if self.max_files is None else f"train[:{self.max_files}]"  # max_files caps rows
        try:
            with mock.patch.object(datasets.config, "HF_HUB_OFFLINE", offline):
                return load(self.source, self.subset, split=split)
        except Exception as err:
            reason = "the hub is offline or unreachable" if offline else f"{type(err).__name__}: {err}".splitlines()[0]
            raise ConfigError(
                f"data.source={self.source!r} is not a local path and could not be loaded from the Hugging Face hub "
                f"({reason}); use data.source={STDLIB} or a local file, directory or glob"
            ) from err

    def _load_tokenizer(self, trained_dir: Path) -> None:
        path = trained_dir if self.tokenizer_path is None else Path(self.tokenizer_path).expanduser()
        try:
            tokenizer = load_tokenizer(path)
        except FileNotFoundError:
            raise ConfigError(f"data.tokenizer_path={self.tokenizer_path!r}: no tokenizer at {path}") from None
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"data.tokenizer_path={self.tokenizer_path!r} has no eos_token to separate documents")
        # Whether the model's embedding holds every id is checked against the model (tp_train.app.preflight).
        self.tokenizer, self.vocab_size, self.tokenizer_source = tokenizer, len(tokenizer), str(path)

    def _blocks_dir(self, corpus_dir: Path) -> Path:
        # Its ids and the one that ends each document (which the packing inserts; it is not in tokenizer.json: two
        # tokenizers may share that file and end documents differently, as Llama 3's base and instruct ones do).
        tokenizer_hash = _digest([self.tokenizer.backend_tokenizer.to_str(), self.tokenizer.eos_token_id])[:12]
        return corpus_dir / f"blocks-b{self.block_size}-val{self.val_fraction}-seed{self.seed}-tok{tokenizer_hash}"

    def _pack(self, documents: datasets.Dataset) -> datasets.DatasetDict:
        """Tokenized, packed and split blocks; raises if the corpus cannot fill one train and one val block."""
        length = self.block_size + 1
        blocks = documents.shuffle(seed=self.seed).map(
            _tokenize_and_pack,
            fn_kwargs={"tokenizer": self.tokenizer, "length": length},
            batched=True,
            batch_size=_MAP_BATCH,
            remove_columns=documents.column_names,
            features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
            load_from_cache_file=False,  # our own cache decides what is fresh
        )
        if len(blocks) < 2:
            tokens = len(_tokenize_and_pack(documents[:], self.tokenizer, 1)["input_ids"])  # blocks of 1 = tokens
            if tokens == 0:
                raise ConfigError(
                    f"data.source={self.source!r} is empty: its files hold 0 tokens of text, and 2 blocks (train and "
                    f"val) of data.block_size+1={length} tokens are needed; use files with text or "
                    f"data.source={STDLIB}"
                )
            raise ConfigError(
                f"data.source={self.source!r} gives {tokens} tokens, fewer than the 2 blocks (train and val) of "
                f"data.block_size+1={length} tokens needed; use a larger corpus or a smaller data.block_size"
            )
        # int() of a fraction below 1 leaves at least one train block; max() keeps at least one val block.
        end = len(blocks) - max(1, int(len(blocks) * self.val_fraction))
        return datasets.DatasetDict(train=blocks.select(range(end)), val=blocks.select(range(end, len(blocks))))


def _tokenize_and_pack(batch: dict[str, list], tokenizer: PreTrainedTokenizerFast, length: int) -> dict[str, list]:
    """Tokenizes documents, appends EOS to each, and cuts their concatenation into blocks of `length` tokens."""
    texts = [text for text in batch["text"] if text]  # an empty file or null record is no document
    stream: list[int] = []
    for ids in tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []:
        stream += [*ids, tokenizer.eos_token_id]
    return {"input_ids": [stream[start : start + length] for start in range(0, len(stream) - length + 1, length)]}


# The special token ids of a tokenizer trained here (`_train_tokenizer`): EOS is its one special token, given the
# first id; it has no pad or bos token.
TRAINED_TOKEN_IDS = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 0}


def special_token_ids(tokenizer_path: str | None) -> dict[str, int | None]:
    """The pad, bos and eos ids (None where it has no such token) of the tokenizer a `TextDataModule` with
    `tokenizer_path` uses: one trained on the corpus (`TRAINED_TOKEN_IDS`), else the one at the path."""
    if tokenizer_path is None:
        return dict(TRAINED_TOKEN_IDS)
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except FileNotFoundError:  # the data module reports it, naming data.tokenizer_path
        return {}
    return {name: getattr(tokenizer, name) for name in TRAINED_TOKEN_IDS}


def _train_tokenizer(documents: datasets.Dataset, vocab_size: int) -> PreTrainedTokenizerFast:
    """A GPT-2-style byte-level BPE tokenizer trained on the documents, with EOS as its one special token."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, so no text is ever out of vocabulary
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet)
    batches = (batch["text"] for batch in documents.iter(batch_size=_MAP_BATCH))
    tokenizer.train_from_iterator(batches, trainer=trainer, length=len(documents))
    trained = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS)
    ids = {name: getattr(trained, name) for name in TRAINED_TOKEN_IDS}
    assert ids == TRAINED_TOKEN_IDS, f"a trained tokenizer's special ids {ids}, not {TRAINED_TOKEN_IDS}"
    return trained


def _hub_reachable(timeout: float = 5.0) -> bool:
    try:
        get_session().head(hub_constants.ENDPOINT, timeout=timeout)
    except Exception:  # DNS, refused, timeout or proxy failure: all mean the hub cannot serve us now
        return False
    return True


def _save_atomically(save: Callable[[str], object], final: Path) -> None:
    """Writes beside `final` and renames into place: a crashed or concurrent build never leaves a half cache."""
    temporary = final.with_name(f"{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    save(str(temporary))
    try:
        temporary.rename(final)
    except OSError:  # another process (e.g. another node on a shared filesystem) finished first; same content
        shutil.rmtree(temporary, ignore_errors=True)


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, default=str).encode()).hexdigest()[:16]
