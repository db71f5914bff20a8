"""Tokenizers read from disk, and finding the one a training run used."""

from __future__ import annotations

from pathlib import Path

from tp_train.checkpoint.dcp import TOKENIZER_KEY

EOS = "<|endoftext|>"  # what tokenizers trained here end a document with
RUN_TOKENIZER = "tokenizer"  # the run's copy: <run>/tokenizer/


def load_tokenizer(path: str | Path):
    """The tokenizer at `path`: a `save_pretrained` directory, or a tokenizer.json (whose EOS is taken to be
    `EOS` when it holds that token: a bare tokenizer.json does not say which token ends a document)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    if not path.is_file():
        raise FileNotFoundError(f"no tokenizer at {path}")
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    if tokenizer.eos_token is None and EOS in tokenizer.get_vocab():
        tokenizer.eos_token = EOS
    return tokenizer


def run_tokenizer(checkpoint: str | Path, extra: dict) -> str | None:
    """Where the tokenizer of the run that saved `checkpoint` (`<run>/checkpoints/<name>`, its metadata `extra`) is:
    the run's own copy, else the path the checkpoint names (runs from before the copy); None when neither."""
    copy = Path(checkpoint).resolve().parent.parent / RUN_TOKENIZER
    return str(copy) if copy.is_dir() else extra.get(TOKENIZER_KEY)
