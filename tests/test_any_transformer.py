"""Transformers that are not causal LMs shard with no plan given: a ViT classifier, T5 and BART (encoder-decoders,
cross-attention included, T5's per-head relative position bias split with its heads), Whisper (mel features in),
CLIP (text and images in), BERT's masked LM, and ALBERT, MPNet and DeBERTa (below). Each is probed on the batch its
config shapes (`tp_train.plan.probe_input`) and matches the unsharded model at tp 2 and 4: outputs, every gradient
and three SGD losses, each rank holding 1/tp of the block matrices."""

from __future__ import annotations

import pytest
import torch

import tp_train
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, batch_parity_errors
from tests.test_parallelize import ATOL
from tp_train.plan.compare import first_tensor
from tp_train.tools.zoo import build_family as build
from tp_train.tools.zoo_tasks import batches

MODELS = {  # name: (zoo task, family)
    "vit": ("image-classification", "vit"),
    "t5": ("seq2seq-lm", "t5"),
    "bart": ("seq2seq-lm", "bart"),
    "whisper": ("speech-seq2seq", "whisper"),
    "clip": ("dual-encoder", "clip"),
    "bert_mlm": ("masked-lm", "bert"),
    # masked LMs the planner reads beyond one attention per layer: ALBERT runs one layer at every depth, MPNet hands
    # every layer the relative bias of all heads (its table whole, each attention cutting its heads), DeBERTa adds
    # per-channel biases to its heads inside attention (split with them)
    "albert": ("masked-lm", "albert"),
    "mpnet": ("masked-lm", "mpnet"),
    "deberta": ("masked-lm", "deberta"),
}


def _forward(model, inputs):
    return first_tensor(inputs(model))


def models_parity(rank, world_size, models=None):
    """Each model's parity errors (`models`: name -> (zoo task, family[, config fields]), default `MODELS`), on one
    rank."""
    import contextlib
    import io

    results = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for name, (task, family, *fields) in (models or MODELS).items():
            torch.manual_seed(0)
            reference = build(task, family, *fields).eval()
            steps = [(inputs, _forward, loss) for inputs, loss in batches(task, reference, steps=3)]
            results[name] = batch_parity_errors(reference, steps)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    return request.param, run_on_ranks(models_parity, request.param, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_non_causal_transformers_match_unsharded_with_no_plan_given(parity_results, name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[name], tp, rank, ATOL)


def test_t5s_relative_position_bias_is_split_with_its_heads():
    """T5's relative_attention_bias, an (buckets, heads) table in each stack's first layer whose bias the later layers
    take as an argument, is split along its heads by a parameter entry, beside the attention it feeds."""
    torch.manual_seed(0)
    plan = tp_train.infer_plan(build("seq2seq-lm", "t5"), tensor_parallel_size=2)
    for stack in ("encoder", "decoder"):
        assert plan[f"{stack}.block.*.layer.*.SelfAttention.relative_attention_bias.weight"] == "rowwise"
        assert plan[f"{stack}.block.*.layer.*.SelfAttention"] == "attention"
    assert plan["decoder.block.*.layer.*.EncDecAttention.q"] == "colwise"  # cross-attention, sharded alike


def test_the_planner_reads_reused_layers_shared_bias_tables_and_per_head_biases():
    """ALBERT's one layer is planned once for every depth; MPNet's encoder-level relative bias stays whole (its
    gradient summed) while each attention takes its heads of it; DeBERTa's q_bias and v_bias split with the heads."""
    torch.manual_seed(0)
    albert = tp_train.infer_plan(build("masked-lm", "albert"), tensor_parallel_size=2)
    assert albert["albert.encoder.albert_layer_groups.*.albert_layers.*.attention.query"] == "colwise"
    mpnet = tp_train.infer_plan(build("masked-lm", "mpnet"), tensor_parallel_size=2)
    assert mpnet["mpnet.encoder.relative_attention_bias"] == "replicated_with_grad_allreduce"
    assert mpnet["mpnet.encoder.layer.*.attention.attn"] == "attention(all_head_size, position_bias[1])"
    deberta = tp_train.infer_plan(build("masked-lm", "deberta"), tensor_parallel_size=2)
    assert deberta["deberta.encoder.layer.*.attention.self.q_bias"] == "colwise"
    assert deberta["deberta.encoder.layer.*.attention"] == "attention(self.num_attention_heads)"
