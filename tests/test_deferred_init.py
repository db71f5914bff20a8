"""A model built on the meta device is materialised shard by shard: the same initial weights at every tp for the
same seed, and each rank's peak memory near its shards plus one full layer, not the full model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks

SMALL = GPTConfig(vocab_size=101, block_size=16, n_layer=2, n_head=4, n_embd=32)
# ~26M parameters (105 MB fp32), its largest layer ~3M: the shards plus one layer are well under the model at tp=2.
LARGE = GPTConfig(vocab_size=4096, block_size=64, n_layer=8, n_head=8, n_embd=512)


def _initial_weights(rank, world_size):
    from models import hugging_face_causal_lm
    from tp_train.tools.zoo.configs import tiny_config

    states = []
    # Mamba2's `_init_weights` draws one number per head of its mixer (`module.num_heads`, a local count once its
    # heads are split): initialising a mixer again after its split (as calling the enclosing modules' initialisers
    # for each child did) drew fewer at tp=2 and shifted every later weight (losses 5.3e-2 apart through train.py).
    for build in (lambda: GPT(SMALL), lambda: hugging_face_causal_lm("mamba2", config=tiny_config("mamba2"))):
        torch.manual_seed(0)
        with tp_train.deferred_init():
            model = build()
        tp_train.parallelize(model, device="cpu", verify=False)
        states.append(tp_train.full_state_dict(model, dist.group.WORLD))
    return states if rank == 0 else None


@pytest.fixture(scope="module")
def weights_at_tp1():
    return run_on_ranks(_initial_weights, 1)[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_meta_init_gives_the_same_weights_at_every_tp(tp, weights_at_tp1):
    for sharded, whole in zip(run_on_ranks(_initial_weights, tp)[0], weights_at_tp1, strict=True):
        assert sharded.keys() == whole.keys()
        for name, tensor in whole.items():
            assert torch.equal(sharded[name], tensor), name
    # Not all zeros or a constant: the weights were really initialised.
    assert weights_at_tp1[0]["blocks.0.mlp.fc.weight"].std() > 0


def _peak_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _init_peak(rank, world_size):
    torch.manual_seed(0)
    with torch.device("meta"):  # a first, small model loads what parallelize imports lazily and caches (about 27 MiB
        warm_up = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))  # at first use)
    tp_train.parallelize(warm_up, device="cpu")
    del warm_up
    with torch.device("meta"):
        model = GPT(LARGE)
    full_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # reset the peak resident set size to the current one
    before = _peak_rss_bytes()
    tp_train.parallelize(model, device="cpu")
    return _peak_rss_bytes() - before, full_bytes


def test_meta_init_peak_memory_per_rank_is_below_the_model_size():
    # tests/distributed.py fixes glibc's mmap threshold for every rank, so resident memory tracks live tensors.
    growth_tp2, full_bytes = run_on_ranks(_init_peak, 2)[0]
    # Shards are half the model; one full layer is ~12% more.
    assert growth_tp2 < 0.75 * full_bytes, (growth_tp2 / 2**20, full_bytes / 2**20)


def test_computed_buffers_of_a_model_planned_through_a_wrapper_are_recomputed_as_its_own_init_does():
    """StableLM has no Hugging Face plan, so the app's auto-planner plans the LightningModule holding it; its rotary
    embedding (non-persistent `inv_freq`, no reset_parameters) built on meta was refused. Each module is initialised
    by the innermost enclosing model's `_init_weights`, which recomputes the buffers (issue 41)."""
    from models import hugging_face_causal_lm
    from tp_train.plan.meta_init import initializer, materialize

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4)  # fmt: skip
    with torch.device("meta"):
        wrapper = torch.nn.ModuleDict({"model": hugging_face_causal_lm("stablelm", config=config)})
    materialized = {}
    for name, module in wrapper.named_modules():
        materialize(name, module, torch.device("cpu"), materialized, initializer(wrapper, name))
    built = hugging_face_causal_lm("stablelm", config=config)
    for buffer in ("inv_freq", "original_inv_freq"):
        expected = getattr(built.model.rotary_emb, buffer)
        assert torch.equal(getattr(wrapper["model"].model.rotary_emb, buffer), expected), buffer


def _meta_built_bert(rank, world_size):
    from models import hugging_face_causal_lm

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    ties = []
    for building in (torch.device("meta"), tp_train.deferred_init()):  # a user's meta build; train.py's
        torch.manual_seed(0)
        with building:
            model = hugging_face_causal_lm("bert", config=config)
        tp_train.parallelize(model, loss_parallel=True, device="cpu", verify=True)
        predictions = model.cls.predictions
        embedding = model.bert.embeddings.word_embeddings.weight
        ties.append(
            (
                predictions.decoder.bias is predictions.bias,
                predictions.decoder.weight.data_ptr() == embedding.data_ptr(),
            )
        )
    return ties


def test_a_decoder_tied_to_the_embedding_and_to_its_parents_bias_keeps_both_ties_built_on_meta():
    """BERT's decoder (`cls.predictions.decoder`) takes its weight from the word embedding, sharded before it, and its
    bias from `cls.predictions.bias`, materialised before it. Built on meta (train.py's path) the decoder was
    materialised afresh: a new random weight (the plan check then found it 1.96 from its shards) and a bias that left
    the parent's behind, with no gradient (issue 41: bert, ctrl, electra, ernie, ... through train.py). Under
    `deferred_init` the parent's bias keeps its constructed zeros and the ties hold as well."""
    assert run_on_ranks(_meta_built_bert, 1)[0] == [(True, True), (True, True)]


# Tensors their constructors compute and their `_init_weights` does not redo (issue 41).
CONSTRUCTED = {
    "apertus": (
        "model.layers.0.mlp.act_fn.alpha_p",
        "model.layers.0.mlp.act_fn.alpha_n",
        "model.layers.0.mlp.act_fn.eps",
    ),
    "data2vec-text": ("lm_head.bias",),
    "falcon_h1": ("model.layers.0.mamba.mup_vector",),
    # Its `_init_weights`, run by `post_init` during the build, copies a draw (meta) into a kept tensor: refused with
    # "Cannot copy out of meta tensor" until such a write was left for `materialize` to redo.
    "zamba": (),
}


@pytest.mark.parametrize("family", sorted(CONSTRUCTED))
def test_values_a_constructor_computes_are_kept_by_deferred_init(family):
    """Built on meta, Apertus' xIELU scalars, Data2VecText's head bias and Falcon-H1's muP vector kept
    `torch.empty`'s memory (1e17 scalars; losses of 1e11): no initialiser redoes them. `deferred_init` (the strategy's
    `init_module`) keeps what the constructor computed, so the materialised model holds what one built on the CPU
    does; the weights it draws are still meta until their shard is materialised."""
    from models import hugging_face_causal_lm
    from tp_train.plan.meta_init import initializer, materialize

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=32)  # fmt: skip
    if family == "falcon_h1":  # a muP vector of distinct multipliers, so each slice's scaling is checked
        config.update(ssm_multipliers=[0.5, 2.0, 3.0, 4.0, 5.0])
    if family == "zamba":  # its layer kinds
        from tp_train.tools.zoo.configs import tiny_config

        config = tiny_config("zamba")
    with tp_train.deferred_init():
        deferred = hugging_face_causal_lm(family, config=config)
    assert deferred.get_output_embeddings().weight.is_meta
    materialized = {}
    for name, module in deferred.named_modules():
        materialize(name, module, torch.device("cpu"), materialized, initializer(deferred, name))
    built = dict(hugging_face_causal_lm(family, config=config).named_parameters(remove_duplicate=False))
    built.update(hugging_face_causal_lm(family, config=config).named_buffers())
    tensors = {**dict(deferred.named_parameters(remove_duplicate=False)), **dict(deferred.named_buffers())}
    for name in CONSTRUCTED[family]:
        assert torch.equal(tensors[name], built[name]), (name, tensors[name], built[name])
    for name, tensor in tensors.items():  # every value initialised: none is torch.empty's memory
        assert not tensor.is_floating_point() or tensor.abs().max() < 1e3, name
    if family == "zamba":  # drawn by its initialiser at materialisation, not the constructor's zeros
        assert tensors["model.layers.0.mamba_decoder.mamba.dt_proj_bias"].abs().min() > 0
