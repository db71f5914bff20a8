"""Whole models sharded by `tp_train.parallelize` compute the same function as unsharded, at tp in {1, 2, 4}."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.parity import VOCAB_OF_TESTS, assert_parity, parity_errors, parity_of_each

ATOL = 1e-5
VOCAB = VOCAB_OF_TESTS


class SwiGLUModel(nn.Module):
    """A model written here, not in models/: separate q/k/v, a packed [gate; up] SwiGLU, RMSNorm, and only a
    `tp_plan` attribute to tell tp_train how to shard it."""

    tp_plan = {
        "embed": "embedding_rowwise",
        "layers.*.attn.q": "colwise",
        "layers.*.attn.k": "colwise",
        "layers.*.attn.v": "colwise",
        "layers.*.attn.out": "rowwise",
        "layers.*.mlp.gate_up": "packed_colwise",
        "layers.*.mlp.down": "rowwise",
        "head": "colwise_gather_output",
    }

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, hidden: int = 48, n_layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(_SwiGLUBlock(dim, heads, hidden) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class _SwiGLUBlock(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = nn.Module()
        self.attn.q, self.attn.k, self.attn.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.attn.out = nn.Linear(dim, dim, bias=False)
        self.head_dim = dim // heads
        self.mlp = nn.Module()
        self.mlp.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.mlp.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        h = self.attn_norm(x)
        q, k, v = (p(h).view(B, T, -1, self.head_dim) for p in (self.attn.q, self.attn.k, self.attn.v))
        if hasattr(self.attn, "q_norm"):  # QKNormModel
            q = self.attn.q_norm(q)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x = x + self.attn.out(y)
        gate, up = self.mlp.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp.down(F.silu(gate) * up)


def _gpt():
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=32, n_layer=2, n_head=4, n_embd=32, dropout=0.0))


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config)


def _hf_gpt_neox():
    """GPT-NeoX fuses query_key_value per head, [q_h; k_h; v_h]: HF's plain "colwise" split keeps heads whole."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPTNeoXForCausalLM(config)


def _logits(model, idx):
    return model(idx)


def _hf_logits(model, idx):
    return model(input_ids=idx).logits


MODELS = {
    "gpt": (_gpt, _logits),
    "hf_gpt2": (_hf_gpt2, _hf_logits),
    "hf_llama_gqa": (_hf_llama, _hf_logits),
    "hf_gpt_neox": (_hf_gpt_neox, _hf_logits),
    "custom_tp_plan": (SwiGLUModel, _logits),
}


def _all_models_parity(rank, world_size):
    return parity_of_each(MODELS)


@pytest.fixture(scope="module", params=[1, 2, 4], ids=lambda tp: f"tp{tp}")
def parity_results(request):
    """One spawn per tp runs every model (spawning ranks dominates the cost); each model is its own test."""
    return request.param, run_on_ranks(_all_models_parity, request.param, timeout=300)


@pytest.mark.parametrize("model_name", list(MODELS))
def test_sharded_model_matches_unsharded(parity_results, model_name):
    tp, per_rank = parity_results
    for rank, results in enumerate(per_rank):
        assert_parity(results[model_name], tp, rank, ATOL)


def _loss_parallel_parity(rank, world_size):
    """GPT with a vocabulary tp does not divide, its head kept vocab-sharded, and the vocab-parallel loss."""
    import copy

    import torch.distributed as dist

    import tp_train
    from tests.parity import full_tensors

    torch.manual_seed(0)
    reference = _gpt()
    model = tp_train.parallelize(copy.deepcopy(reference), loss_parallel=True)
    idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    inputs, targets = idx[:, :-1], idx[:, 1:].flatten()
    ref_loss = F.cross_entropy(reference(inputs).flatten(0, 1), targets)
    logits = model(inputs)  # (B, T, padded vocab / tp)
    loss = tp_train.vocab_parallel_cross_entropy(logits.flatten(0, 1), targets, dist.group.WORLD, vocab_size=VOCAB)
    ref_loss.backward()
    loss.backward()
    ref_params = dict(reference.named_parameters())
    grads = full_tensors(model, dist.group.WORLD, grads=True)
    grad_error = max((ref_params[name].grad - grad).abs().max().item() for name, grad in grads.items())
    return logits.shape[-1], (ref_loss - loss).abs().item(), grad_error


@pytest.mark.parametrize("tp", [2, 4])
def test_loss_parallel_matches_full_logits_loss_with_a_padded_vocabulary(tp):
    for width, loss_error, grad_error in run_on_ranks(_loss_parallel_parity, tp):
        assert width == -(-VOCAB // tp)  # the head stayed sharded (and padded)
        assert loss_error < ATOL and grad_error < ATOL, (loss_error, grad_error)


class QKNormModel(SwiGLUModel):
    """SwiGLUModel whose attention normalises q over head_dim (as Qwen3 and OLMo2 do): one norm weight, applied on
    every rank to that rank's local heads only, so its gradient must be summed over the TP group."""

    tp_plan = {**SwiGLUModel.tp_plan, "layers.*.attn.q_norm": "replicated_with_grad_allreduce"}

    def __init__(self):
        super().__init__()
        for layer in self.layers:
            layer.attn.q_norm = nn.RMSNorm(layer.head_dim)
            with torch.no_grad():
                layer.attn.q_norm.weight.uniform_(0.5, 1.5)


def _qk_norm_parity(rank, world_size, with_grad_allreduce):
    torch.manual_seed(0)
    model = QKNormModel()
    if not with_grad_allreduce:  # the negative control: the same model, the norm left plainly replicated
        model.tp_plan = SwiGLUModel.tp_plan
    # verify=False: without the gradient sum, parity itself must show the difference.
    errors = parity_errors(model, _logits, VOCAB, steps=1, parallelize_kwargs=dict(verify=False))
    return {key: value for key, value in errors.items() if "q_norm" in key or key == "logits"}


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_over_local_heads_needs_and_gets_its_gradient_summed(tp):
    for errors in run_on_ranks(_qk_norm_parity, tp, True):
        assert len(errors) == 5 and max(errors.values()) < ATOL, errors  # logits, 2 grads, 2 params
    without = run_on_ranks(_qk_norm_parity, tp, False)[0]
    assert without["logits"] < ATOL  # the forward is right either way...
    assert max(v for k, v in without.items() if k.startswith("grad:")) > 1e-3  # ...the gradient is not


def _planned_once(rank, world_size):
    """How often this rank ran the auto-planner for a model with no plan, the shapes it sharded to, and the refusal
    it raised for a model whose heads do not split over the ranks."""
    import tp_train
    import tp_train.plan.deciding.resolve as resolve
    from tests.attention_styles import literal_heads

    calls = []
    planner = resolve.infer_plan
    resolve.infer_plan = lambda *args, **kwargs: calls.append(1) or planner(*args, **kwargs)
    torch.manual_seed(0)
    shapes = _shapes(tp_train.parallelize(literal_heads(), verify=False))
    torch.manual_seed(0)
    three_heads = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=1, n_head=3, n_embd=24))
    try:
        tp_train.parallelize(three_heads, verify=False)
    except ValueError as error:
        return len(calls), shapes, str(error)
    return len(calls), shapes, None


def _shapes(model: nn.Module) -> list:
    return sorted((name, tuple(value.shape)) for name, value in model.state_dict().items())


def test_the_first_rank_plans_and_every_rank_takes_its_plan_or_its_refusal():
    from tests.attention_styles import literal_heads

    (calls0, shapes0, refusal0), (calls1, shapes1, refusal1) = run_on_ranks(_planned_once, 2)
    assert (calls0, calls1) == (1, 0)
    assert shapes0 == shapes1 != _shapes(literal_heads())  # sharded, by one plan
    assert refusal0 == refusal1 and "n_head=3" in refusal0 and "\n" not in refusal0


def _decisions(rank, world_size):
    """What `first_rank_decides` returned on this rank and how often this rank decided, then the error it raised."""
    from tp_train.errors import DiskFullError
    from tp_train.parallel.mesh import first_rank_decides

    calls = []
    value = first_rank_decides(lambda: calls.append(rank) or {"rank": rank})

    def refuse():
        raise DiskFullError(f"no space on rank {rank}")

    try:
        first_rank_decides(refuse)
    except DiskFullError as error:
        return value, calls, str(error)
    return value, calls, None


def test_the_first_rank_decides_for_every_rank_and_its_error_is_raised_on_every_rank():
    results = run_on_ranks(_decisions, 2)
    assert [value for value, _, _ in results] == [{"rank": 0}, {"rank": 0}]
    assert [calls for _, calls, _ in results] == [[0], []]
    assert [error for _, _, error in results] == ["no space on rank 0", "no space on rank 0"]
