"""A small "pretrained" Llama (random weights) with its own byte-level BPE tokenizer, in `tiny-llama/`, and a corpus
to fine-tune it on, `corpus.txt`, both in the current directory, from the Python standard library's own source (no
network needed). docs/fine-tuning.md and the README use it; tests/test_finetune.py runs it."""

import sysconfig
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

DIR = "tiny-llama"
texts = [p.read_text(errors="replace") for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:40]]
bpe = Tokenizer(models.BPE())
bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
alphabet = pre_tokenizers.ByteLevel.alphabet()
bpe.train_from_iterator(
    texts, trainers.BpeTrainer(vocab_size=1024, special_tokens=["<eos>"], initial_alphabet=alphabet)
)
tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
config = LlamaConfig(
    vocab_size=len(tokenizer),
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=tokenizer.eos_token_id,
    eos_token_id=tokenizer.eos_token_id,
)
torch.manual_seed(0)  # the same "pretrained" weights on every run: what a model learns from them is reproducible
LlamaForCausalLM(config).save_pretrained(DIR)
tokenizer.save_pretrained(DIR)
stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[40:70]  # other files than the tokenizer's
Path("corpus.txt").write_text("\n\n".join(p.read_text(errors="replace") for p in stdlib))
