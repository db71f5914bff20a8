"""Fewer kv heads than ranks (grouped-query attention at a large tp, multi-query's single kv head): each rank holds
the kv heads its own query heads use, the ranks sharing one (its replicas) sum their partial gradients, and
checkpoints store each head once.

- Falcon multi-query (the preset), Llama with 1 and 2 kv heads and phi3 with 2 (Hugging Face's plan, phi3's
  head-aware one) match the unsharded model at tp 2 and 4 with no plan passed.
- After 10 AdamW steps at tp=4 the replicas are bit-identical (weights and optimizer state); the global gradient
  norm (for clipping) counts each replicated head once.
- A tp=4 checkpoint (each head replicated twice) loads at tp=4 and at tp=2 (no replication) with the same weights,
  optimizer state and logits, and exports to a `save_pretrained` directory with the same logits.
"""

from __future__ import annotations

import copy
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, next_token_loss, parity_of_each
from tests.test_hf_families import _hf_falcon
from tests.test_parallelize import ATOL, VOCAB
from tp_train.parallel.sharding import named_sharded_parameters, unshard_tensor

SIZES = dict(pad_token_id=0, vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=8, max_position_embeddings=64)  # fmt: skip


def _hf(model_type: str, kv_heads: int):
    from models.hf import hugging_face_causal_lm

    return hugging_face_causal_lm(model_type, config={**SIZES, "num_key_value_heads": kv_heads}).eval()


def _logits(model, idx):
    return model(idx).logits


# name -> (build, how far above 1/tp a rank's share may be: each replicated k and v is held 1/kv_heads per rank)
FAMILIES = {
    "falcon_multi_query": (partial(_hf_falcon, multi_query=True, hidden_size=64, num_attention_heads=8), 0.15),
    "llama_1_kv_head": (partial(_hf, "llama", 1), 0.15),
    "llama_2_kv_heads": (partial(_hf, "llama", 2), 0.1),
    "phi3_2_kv_heads": (partial(_hf, "phi3", 2), 0.1),
}


def _parity_cases(rank, world_size):
    return parity_of_each({name: (build, _logits) for name, (build, _) in FAMILIES.items()})


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(_parity_cases, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(FAMILIES))
def test_sharded_with_no_plan_given_matches_unsharded(parity_results, name):
    tp, results = parity_results
    for rank, result in enumerate(results):
        assert_parity(result[name], tp, rank, atol=ATOL, block_rel_tol=FAMILIES[name][1])


IDX = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))


def _gathered(model, optimizer, group) -> dict[str, torch.Tensor]:
    """Every sharded parameter and its AdamW moments, at full size."""
    full = {}
    for name, param, spec in named_sharded_parameters(model):
        full[name] = unshard_tensor(param.detach(), spec, group)
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}:{key}"] = unshard_tensor(optimizer.state[param][key], spec, group)
    return full


def _train_and_save(rank, world_size, directory):
    """10 AdamW steps of Llama with 2 kv heads at tp=4, then a checkpoint. Returns whether each replicated tensor
    (parameters and AdamW moments) is bit-identical on its replicas, the full tensors and the logits."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    group = mesh.get_group()
    torch.manual_seed(0)
    reference = _hf("llama", 2)
    model = tp_train.parallelize(copy.deepcopy(reference), mesh)
    for each in (reference, model):  # the gradient norm counts each replicated kv head once
        next_token_loss(each(IDX).logits, IDX).backward()
    specs = {id(param): spec for _, param, spec in named_sharded_parameters(model)}
    norms = [tp_train.global_grad_norm(model.parameters(), specs, group).item()]
    norms.append(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]).item())
    model.zero_grad()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(10):
        idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(step))
        next_token_loss(model(idx).logits, idx).backward()
        optimizer.step()
        optimizer.zero_grad()
    identical = {}
    for name, param, spec in named_sharded_parameters(model):
        if max(spec.replicas(world_size)) == 1:
            continue
        for label, tensor in (("", param.detach()), (":exp_avg", optimizer.state[param]["exp_avg"])):
            everyone = [torch.empty_like(tensor) for _ in range(world_size)]
            dist.all_gather(everyone, tensor.contiguous(), group=group)
            identical[name + label] = all(
                torch.equal(everyone[r], everyone[r ^ 1]) for r in range(world_size)
            )  # ranks 2k and 2k+1 share kv head k
    tp_train.save_checkpoint(Path(directory) / "llama", model, [optimizer], mesh)
    with torch.no_grad():
        logits = model(IDX).logits
    gathered, reloaded = _gathered(model, optimizer, group), _load(rank, world_size, directory)[0]
    identical["reloaded at tp=4"] = all(torch.equal(reloaded[name], tensor) for name, tensor in gathered.items())
    return identical, gathered, logits, norms


def _load(rank, world_size, directory):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(1)  # other initial weights: everything must come from the checkpoint
    model = tp_train.parallelize(_hf("llama", 2), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tp_train.load_checkpoint(Path(directory) / "llama", model, [optimizer], mesh)
    return gathered_and_logits(model, optimizer, mesh, IDX)


def gathered_and_logits(model, optimizer, mesh, idx) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """`_gathered`, and the logits on `idx`."""
    with torch.no_grad():
        logits = model(idx).logits
    return _gathered(model, optimizer, mesh.get_group()), logits


@pytest.mark.slow
def test_replicas_stay_identical_and_a_tp4_checkpoint_loads_at_tp2_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    from tp_train.tools.export import export_hugging_face

    saved = run_on_ranks(_train_and_save, 4, str(tmp_path), timeout=300)
    identical, trained, logits, (norm, reference_norm) = saved[0]
    assert identical and all(identical.values()), identical
    assert abs(norm - reference_norm) < 1e-5 * reference_norm, (norm, reference_norm)
    assert any(".k_proj." in name for name in identical) and any(".v_proj." in name for name in identical)
    loaded, loaded_logits = run_on_ranks(_load, 2, str(tmp_path), timeout=300)[0]
    assert loaded.keys() == trained.keys()
    for name, tensor in trained.items():
        assert torch.equal(loaded[name], tensor), name
    assert (loaded_logits - logits).abs().max().item() < ATOL
    out = export_hugging_face(tmp_path / "llama", tmp_path / "llama_hf", config=_hf("llama", 2).config)
    with torch.no_grad():
        exported = AutoModelForCausalLM.from_pretrained(out)(IDX).logits
    assert (exported - logits).abs().max().item() < ATOL
