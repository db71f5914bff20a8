"""Communication counts: a sharded block costs exactly Megatron's minimum, one all-reduce per attention and one per
MLP in the forward pass, the same in the backward pass. Counted by wrapping torch.distributed.all_reduce."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.test_parallelize import VOCAB, _hf_gpt2, _hf_llama


class _AllReduceCounter:
    def __init__(self):
        self.count = 0
        self._original = dist.all_reduce

    def __enter__(self):
        def counting(*args, **kwargs):
            self.count += 1
            return self._original(*args, **kwargs)

        dist.all_reduce = counting
        return self

    def __exit__(self, *exc):
        dist.all_reduce = self._original


def _count(fn, *args):
    """(all-reduces made by fn(*args), its result)."""
    with _AllReduceCounter() as counter:
        result = fn(*args)
    return counter.count, result


def _gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32))


def _block_counts(rank, world_size):
    torch.manual_seed(0)
    block = tp_train.parallelize(_gpt()).blocks[0]
    out = {}
    x = torch.randn(2, 8, 32, requires_grad=True)
    out["block_forward"], y = _count(block, x)
    out["block_backward"], _ = _count(y.sum().backward)
    out["attention_forward"], _ = _count(block.attn, torch.randn(2, 8, 32))
    out["mlp_forward"], _ = _count(block.mlp, torch.randn(2, 8, 32))
    # Whole models: 2 per block, plus one for the vocab-parallel embedding (forward) and one for the LM head's
    # entry into the parallel region (backward); the head's gather is an all-gather.
    for name, build in {"gpt": _gpt, "hf_gpt2": _hf_gpt2, "hf_llama": _hf_llama}.items():
        sharded = tp_train.parallelize(build())
        idx = torch.randint(0, VOCAB, (2, 8))
        out[f"{name}_forward"], logits = _count(sharded, idx)
        logits = logits if name == "gpt" else logits.logits
        out[f"{name}_backward"], _ = _count(logits.sum().backward)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_one_all_reduce_per_sub_block_each_way(tp):
    counts = run_on_ranks(_block_counts, tp, timeout=180)[0]
    n_layer = 2
    assert counts["block_forward"] == 2 and counts["block_backward"] == 2, counts
    assert counts["attention_forward"] == 1 and counts["mlp_forward"] == 1, counts
    for name in ("gpt", "hf_gpt2", "hf_llama"):
        assert counts[f"{name}_forward"] == 2 * n_layer + 1, (name, counts)
        assert counts[f"{name}_backward"] == 2 * n_layer + 1, (name, counts)
