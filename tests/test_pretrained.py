"""Sharded loading: a `save_pretrained` directory (a single safetensors file, or sharded files with an index) loads
into a model built on the meta device and sharded at tp=2, equal to `from_pretrained`'s unsharded model, each rank
reading from the files only its own slices (counted on every `get_slice` read)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_train
from models import hugging_face_causal_lm
from tests.distributed import run_on_ranks
from tests.test_parallelize import ATOL, VOCAB, _hf_gpt2, _hf_gpt_neox, _hf_llama
from tp_train.checkpoint import pretrained
from tp_train.parallel.sharding import full_numel

# GPT-2: tied embeddings, a padded vocabulary, Conv1D (transposed) weights, a fused [q; k; v]; saved in several
# files with an index. GPT-NeoX: its lm_head saved as `embed_out`. Llama: grouped kv heads.
FAMILIES = {"gpt2": (_hf_gpt2, "20KB"), "gpt_neox": (_hf_gpt_neox, None), "llama": (_hf_llama, None)}


class _CountingSafeOpen:
    """safetensors.safe_open that counts the elements every `get_slice(...)[...]` returns."""

    elements = 0
    real = None  # safetensors.safe_open

    def __init__(self, *args, **kwargs):
        self._handle = _CountingSafeOpen.real(*args, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def keys(self):
        return self._handle.keys()

    def get_slice(self, key):
        return _CountingSlice(self._handle.get_slice(key))


class _CountingSlice:
    def __init__(self, stored):
        self._stored = stored

    def get_shape(self):
        return self._stored.get_shape()

    def __getitem__(self, index):
        data = self._stored[index]
        _CountingSafeOpen.elements += data.numel()
        return data


def _load_sharded(rank, world_size, directories):
    from transformers import AutoModelForCausalLM

    _CountingSafeOpen.real, pretrained.safe_open = pretrained.safe_open, _CountingSafeOpen
    results = {}
    try:
        for name, directory in directories.items():
            torch.manual_seed(100 + rank)  # a different random init on each rank: the files must overwrite it all
            with torch.device("meta"):
                model = hugging_face_causal_lm(path=directory)
            _CountingSafeOpen.elements = 0
            if name == "llama":  # the explicit argument, rather than the path the model recorded
                del model.pretrained_weights
                tp_train.parallelize(model, device="cpu", weights=directory)
            else:
                tp_train.parallelize(model, device="cpu")
            read = _CountingSafeOpen.elements
            reference = AutoModelForCausalLM.from_pretrained(directory)
            idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                error = (model(input_ids=idx).logits - reference(input_ids=idx).logits).abs().max().item()
            in_files = sum(t.numel() for t in reference.state_dict().values()) - _tied_numel(reference)
            sharded = sum(full_numel(p, spec) for _, p, spec in tp_train.named_sharded_parameters(model))
            results[name] = dict(error=error, read=read, in_files=in_files, sharded=sharded)
    finally:
        pretrained.safe_open = _CountingSafeOpen.real
    results["strategy_error"] = _strategy_loads(directories["llama"])
    return results


def _tied_numel(model) -> int:
    """Elements counted twice by state_dict (a tied weight under two names), which the files hold once."""
    seen, tied = set(), 0
    for tensor in model.state_dict(keep_vars=True).values():
        tied += tensor.numel() if id(tensor) in seen else 0
        seen.add(id(tensor))
    return tied


@pytest.fixture(scope="module")
def directories(tmp_path_factory):
    out = {}
    for name, (build, max_shard_size) in FAMILIES.items():
        torch.manual_seed(0)
        directory = tmp_path_factory.mktemp(name)
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        build().save_pretrained(directory, **kwargs)
        out[name] = str(directory)
    assert (Path(out["gpt2"]) / pretrained.INDEX_FILE).exists()  # really several files
    return out


@pytest.mark.slow
def test_sharded_loading_equals_from_pretrained_and_each_rank_reads_only_its_slices(directories):
    tp = 2
    per_rank = run_on_ranks(_load_sharded, tp, directories, timeout=300)
    for name in FAMILIES:
        results = [ranks[name] for ranks in per_rank]
        for rank, result in enumerate(results):
            assert result["error"] < ATOL, (name, rank, result)
            # Replicated tensors whole, plus about half of the sharded ones.
            replicated = result["in_files"] - result["sharded"]
            assert result["read"] <= replicated + result["sharded"] / tp + VOCAB, (name, rank, result)
        # Every sharded element was read by exactly one rank, every replicated one by each.
        total = sum(result["read"] for result in results)
        assert total == tp * (results[0]["in_files"] - results[0]["sharded"]) + results[0]["sharded"], (name, results)
        print(f"{name}: each rank read {[r['read'] for r in results]} of {results[0]['in_files']} elements")
    # The path `python train.py model=hf model.path=...` takes: TensorParallelStrategy shards, then fills.
    assert all(ranks["strategy_error"] < ATOL for ranks in per_rank), per_rank


def test_a_base_models_file_loads_into_a_model_with_a_head(tmp_path):
    """Keys without the `transformer.` prefix (saved from GPT2Model) fill GPT2LMHeadModel; its tied head follows."""
    torch.manual_seed(0)
    source = _hf_gpt2()
    source.transformer.save_pretrained(tmp_path)
    torch.manual_seed(1)
    model = _hf_gpt2()
    read = pretrained.load_pretrained(model, tmp_path / pretrained.SINGLE_FILE)  # a file, not a directory
    assert read == sum(t.numel() for t in source.transformer.state_dict().values())  # unsharded: everything, once
    for name, tensor in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name


def test_weights_the_model_does_not_fit_are_refused(tmp_path):
    torch.manual_seed(0)
    _hf_gpt2().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="hold no tensor for"):
        pretrained.load_pretrained(_hf_llama(), tmp_path)
    with pytest.raises(FileNotFoundError, match="neither a .safetensors file nor a directory"):
        pretrained.load_pretrained(_hf_llama(), tmp_path / "nothing")


def _strategy_loads(directory):
    """The path `python train.py model=hf model.path=...` takes: built on meta in configure_model, sharded and
    filled by TensorParallelStrategy."""
    from functools import partial

    from torch.utils.data import DataLoader
    from transformers import AutoModelForCausalLM

    from tests.lightning_helpers import make_trainer, token_data

    torch.manual_seed(100 + dist.get_rank())
    module = tp_train.CausalLMModule(
        model=partial(hugging_face_causal_lm, path=directory), optimizer=partial(torch.optim.SGD, lr=0.0)
    )
    blocks = token_data(1).tensors[0]  # CausalLMModule takes plain (B, T) batches
    make_trainer(dist.get_world_size()).validate(module, DataLoader(blocks, batch_size=4), verbose=False)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(directory)(input_ids=idx).logits
        return (module(idx) - expected).abs().max().item()
