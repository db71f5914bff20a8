"""Planner fixes found by the zoo, each on a tiny Hugging Face model of the family that showed it (and a test model
for the one no small family shows): ELECTRA's embedding projection is no column layer; an MoE router beside experts
the model's own plan shards stays whole, but a block that would stay mostly whole is refused; GPT-BigCode's
multi-query attention shards with its one kv head on every rank; Apertus's activation scalars get summed gradients;
a module running its own sharded 3-D weights under `all_reduce` (Inkling's shared experts) sums its input gradient,
and a swapped embedding keeps its subclass's child modules (Inkling's embedding norm); gated delta-net linear attention
(OLMo-Hybrid, Kimi-Linear, Ling) is split by heads, its conv1d by the [q; k; v] sections. Mamba2's mixer shards by
heads and groups, as Megatron does (in_proj's [z; x; B; C; dt] and conv1d's [x; B; C] section by section); with
fewer groups than ranks (Bamba's and GraniteMoeHybrid's one group, as real checkpoints have) each group's B and C are
held whole by the ranks its heads are on, their gradients summed, and the gated norm normalises each group across
those ranks; a group count that neither divides nor is divisible by tp is refused in one line; Nemotron-H's, Bamba's
and GraniteMoeHybrid's Mamba2 layers the same way, and Zamba2's, beside its tied shared block and its adapters; Zamba's
multi-head Mamba splits by its heads. BitNet's RMS norms between the column and the row layers are split
with the features and normalise over all of them. CodeGen's attention, four hard-coded groups of [q; v; k], is split
by each group's heads, its row layer by the groups. xLSTM's feed-forward with its gate zero at initialisation, and its
mLSTM cell by heads with its per-head norm."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.distributed import run_on_ranks
from tests.parity import assert_parity, parity_errors
from tests.test_parallelize import ATOL, _hf_logits
from tp_train.plan.deciding.resolve import resolve_plan

VOCAB = 128  # the zoo's tiny vocabulary


def _family(model_type: str, **overrides) -> nn.Module:
    from models.hf import hugging_face_causal_lm
    from tp_train.tools.zoo import tiny_config

    torch.manual_seed(0)
    return hugging_face_causal_lm(model_type, config={**tiny_config(model_type), **overrides}).eval()


def test_electras_embedding_projection_is_no_column_of_the_first_query():
    """Its output feeds the first block's query, key, value and residual: pairing it with the query (its only
    producer) is dropped, and the block pairs as any BERT's."""
    plan, _ = resolve_plan(_family("electra"), tensor_parallel_size=2)
    assert "electra.embeddings_project" not in plan
    assert plan["electra.encoder.layer.*.attention.self.query"] == "colwise"
    assert plan["electra.encoder.layer.*.attention.output.dense"] == "rowwise"


def test_a_router_beside_experts_the_plan_shards_stays_whole():
    plan, source = resolve_plan(_family("phimoe"), tensor_parallel_size=2)
    assert "completed by the auto-planner" in source
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert not any("router" in pattern for pattern in plan)


def test_a_block_left_mostly_whole_by_an_unpaired_linear_is_refused():
    """JetMoE's experts are 3-D weights no plan shards: its routers left whole would leave the whole block whole."""
    with pytest.raises(ValueError) as refusal:
        resolve_plan(_family("jetmoe"), tensor_parallel_size=2)
    message = str(refusal.value)
    assert "router.layer" in message and "its block would keep 100% of its parameters whole" in message
    assert "\n" not in message


def test_a_plan_the_auto_planner_completes_still_says_which_attention_it_kept_whole():
    """As Inkling's: the model's own plan shards no block; the completion keeps an attention whole (a literal head
    count), and its note counts what the model's own plan shards too."""
    from tests import attention_styles

    torch.manual_seed(0)
    model = attention_styles.literal_heads()
    model.tp_plan = {"lm_head": "colwise_gather_output"}
    plan, source = resolve_plan(model, tensor_parallel_size=2)
    assert source.endswith("completed by the auto-planner") and plan["h.*.attn"] == "replicate"
    (note,) = plan.notes
    # the MLPs and the embedding, inferred, and the head, from the model's own plan
    sharded = sum(p.numel() for p in [*model.lm_head.parameters(), *model.wte.parameters()])
    sharded += sum(p.numel() for block in model.h for p in block.mlp.parameters())
    fraction = sharded / sum(p.numel() for p in model.parameters())
    assert "attention 'h.*.attn' kept whole on every rank" in note and f"{fraction:.0%} of the parameters" in note


def test_sequence_parallel_refuses_a_row_layer_whose_output_feeds_a_parallel_region():
    """Mamba's x_proj: under sequence parallelism its output would be sequence-sharded, yet it feeds every token of
    each rank's channels."""
    from tests.test_channels import MAMBA_PLAN
    from tests.test_never_silently_wrong import _hf_family
    from tp_train.plan.applying.sequence_parallel import check_sequence_parallel
    from tp_train.plan.deciding.match import match_plan
    from tp_train.plan.layout import block_layout

    model = _hf_family("mamba")
    layout = block_layout(model, match_plan(model, MAMBA_PLAN, 2), "sequence_parallel")
    with pytest.raises(ValueError, match=r"does not support 'backbone.layers.0.mixer.x_proj' planned 'rowwise\(feeds"):
        check_sequence_parallel(model, layout)


class _SharedExperts(nn.Module):
    """Inkling's shared experts: fused 3-D weights, (experts, out, in), run by the module's own forward."""

    def __init__(self, width: int, hidden: int, experts: int = 2):
        super().__init__()
        self.gate_proj = nn.Parameter(torch.randn(experts, hidden, width) / width**0.5)
        self.up_proj = nn.Parameter(torch.randn(experts, hidden, width) / width**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, width, hidden) / hidden**0.5)

    def forward(self, x):
        out = 0
        for gate, up, down in zip(self.gate_proj, self.up_proj, self.down_proj, strict=True):
            out = out + F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
        return out


class _NormedEmbedding(nn.Embedding):
    """Inkling's embedding: a subclass whose forward normalises the lookup with a child module."""

    def __init__(self, vocab: int, width: int):
        super().__init__(vocab, width)
        self.embed_norm = nn.LayerNorm(width)

    def forward(self, input_ids):
        return self.embed_norm(super().forward(input_ids))


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.shared_experts = _SharedExperts(width, 2 * width)

    def forward(self, x):
        return x + self.shared_experts(self.norm(x))


class InklingStyleLM(nn.Module):
    def __init__(self, vocab: int = VOCAB, width: int = 16):
        super().__init__()
        self.embed = _NormedEmbedding(vocab, width)
        self.layers = nn.ModuleList(_Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)
        self.tp_plan = {
            "embed": "embedding_rowwise",
            "layers.*.shared_experts.gate_proj": "colwise",
            "layers.*.shared_experts.up_proj": "colwise",
            "layers.*.shared_experts.down_proj": "rowwise",
            "layers.*.shared_experts": "all_reduce",
        }

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_mamba2_is_sharded_by_heads_and_groups_section_by_section():
    plan, source = resolve_plan(_family("mamba2"), tensor_parallel_size=2)
    assert source == "the built-in preset for model_type 'mamba2'"
    # tiny config: 8 heads of 8 (inner 64), 8 groups with a 16-wide state (B and C 8 x 16 each)
    assert plan["backbone.layers.*.mixer.in_proj"] == "colwise(64,64,8x16,8x16,8)"
    assert plan["backbone.layers.*.mixer.conv1d"] == "channelwise(64,8x16,8x16)"
    assert plan["backbone.layers.*.mixer.norm"] == "gated_rmsnorm_parallel"


def test_falcon_h1s_mup_vector_is_split_with_in_proj_and_its_gated_norm_refused():
    """Falcon-H1 ships no plan: its Mamba2 mixers are added (width `mamba_d_ssm`), and the `mup_vector` buffer scaling
    in_proj's output takes in_proj's sections along its last dim; the optional gated norm, and a model built on the
    meta device, are refused in one line."""
    plan, _ = resolve_plan(_family("falcon_h1"), tensor_parallel_size=2)
    assert plan["model.layers.*.mamba.in_proj"] == "colwise(64,64,1x16,1x16,8)"
    assert plan["model.layers.*.mamba.mup_vector"] == plan["model.layers.*.mamba.in_proj"]
    assert "model.layers.*.mamba.norm" not in plan  # an identity without mamba_rms_norm
    with pytest.raises(ValueError) as refusal:
        resolve_plan(_family("falcon_h1", mamba_rms_norm=True), tensor_parallel_size=2)
    message = str(refusal.value)
    assert "'falcon_h1'" in message and "mamba_rms_norm=True" in message and "\n" not in message
    # Built on meta, mup_vector would be left unset (its values come from FalconH1Model's _init_weights): refused.
    with torch.device("meta"):
        on_meta = _family("falcon_h1")
    with pytest.raises(ValueError, match="built on the meta device, its mixers' mup_vector buffers would stay unset"):
        resolve_plan(on_meta, tensor_parallel_size=2)


def test_zambas_mixers_split_by_heads_and_its_shared_block_feeds_linear_by_rows():
    """Zamba's per-head SSM weights split along their heads (dim 0, whatever their other dims hold), with a one-line
    refusal where tp does not divide the heads; Zamba2's mixers are Mamba2's, in Mamba and hybrid layers alike."""
    from tp_train.plan.deciding.match import match_plan

    plan, source = resolve_plan(_family("zamba"), tensor_parallel_size=2)
    assert source == "the built-in preset for model_type 'zamba'"
    mixer = "model.layers.*.mamba_decoder.mamba"
    assert plan[mixer] == "attention(n_mamba_heads, intermediate_size)"
    assert plan[f"{mixer}.x_proj_weight"] == plan[f"{mixer}.A_log"] == "channelwise"
    assert plan["model.layers.*.shared_transf.feed_forward.down_proj"] == "rowwise_scatter_output"
    assert plan["model.layers.*.linear"] == "rowwise"
    model = _family("zamba", n_mamba_heads=2)
    with pytest.raises(ValueError) as refusal:
        match_plan(model, resolve_plan(model, tensor_parallel_size=4)[0], 4)
    message = str(refusal.value)
    assert "(ZambaMambaMixer): n_mamba_heads=2 is not divisible by tensor_parallel_size=4" in message
    assert "\n" not in message
    plan, _ = resolve_plan(_family("zamba2"), tensor_parallel_size=2)
    for mixer in ("model.layers.*.mamba", "model.layers.*.mamba_decoder.mamba"):
        assert plan[f"{mixer}.in_proj"] == "colwise(64,64,1x8,1x8,8)"  # [z; x; B; C; dt], one group of 8
        assert plan[f"{mixer}.norm"] == "gated_rmsnorm_parallel"
    assert plan["model.layers.*.shared_transformer.feed_forward.gate_up_proj_adapter_list.*.1"] == "packed_colwise"


MIXERS = {"mamba2": "backbone.layers.0.mixer' (Mamba2Mixer)", "bamba": "model.layers.0.mamba' (BambaMixer)"}


@pytest.mark.parametrize("model_type", list(MIXERS))
def test_mamba2_with_groups_tp_neither_divides_nor_multiplies_is_refused_in_one_line(model_type):
    """3 groups (of 6 heads of 16) at tp=2: a rank would hold a group and a half of B and C, and of the norm."""
    from tp_train.plan.deciding.match import match_plan

    if model_type == "bamba":
        sizes = dict(mamba_n_groups=3, mamba_n_heads=6, mamba_d_head=16, mamba_expand=3)
    else:
        sizes = dict(n_groups=3, num_heads=6, head_dim=16, expand=3)
    model = _family(model_type, **sizes)
    plan, _ = resolve_plan(model, tensor_parallel_size=2)
    with pytest.raises(ValueError) as refusal:
        match_plan(model, plan, 2)
    message = str(refusal.value)
    assert f"'{MIXERS[model_type]}: n_groups holds 3 heads or groups of 1, which tensor_parallel_size=2" in message
    assert "use a tensor_parallel_size in [1, 3] or a multiple of 3" in message and "\n" not in message


def test_dbrx_expert_weights_are_split_expert_by_expert_and_bad_sections_are_refused_in_one_line():
    """DBRX's 2-D expert weights hold every expert's ffn rows in turn: each is split by per-expert sections, the
    experts' view of ffn_hidden_size made local; sections that do not add up are refused naming the parameter."""
    from tp_train.plan.deciding.match import match_plan

    model = _family("dbrx")
    plan, source = resolve_plan(model, tensor_parallel_size=2)
    assert "built-in additions for model_type 'dbrx'" in source
    planned = {entry.name: entry for entry in match_plan(model, plan, 2)}
    experts = planned["transformer.blocks.0.ffn.experts"]
    assert (experts.style, experts.arguments) == ("moe_tp_experts", "ffn_hidden_size")
    weights = planned["transformer.blocks.0.ffn.experts.mlp"].parameters
    assert weights == dict.fromkeys(("w1", "v1", "w2"), "colwise(32,32,32,32)")
    assert "transformer.blocks.0.ffn.router.layer" not in planned  # the router stays whole
    with pytest.raises(ValueError) as refusal:
        match_plan(model, {**plan, "transformer.blocks.*.ffn.experts.mlp.w1": "colwise(32,32,32)"}, 2)
    message = str(refusal.value)
    assert "parameter 'transformer.blocks.0.ffn.experts.mlp.w1' (128, 32): style 'colwise(32,32,32)' must be" in message
    assert "section sizes that add up to dim 0 (128)" in message and "\n" not in message


def test_rwkvs_preset_splits_its_head_and_keeps_the_channel_mix_receptance_whole():
    """RWKV's LM head is named `head` (its output embeddings), not `lm_head`: the preset splits it all the same."""
    plan, source = resolve_plan(_family("rwkv"), tensor_parallel_size=2)
    assert source == "the built-in preset for model_type 'rwkv'"
    assert plan["head"] == "colwise_gather_output"
    assert plan["rwkv.blocks.*.feed_forward.receptance"] == "replicate"
    assert plan["rwkv.blocks.*.attention.time_decay"] == plan["rwkv.blocks.*.attention.time_first"] == "colwise"


def _logits(model, idx):
    return model(idx)


def forward_without_cache_logits(model, idx):
    from tp_train.plan.probe import forward_without_cache

    return forward_without_cache(model, idx).logits


def _rwkv() -> nn.Module:
    """RWKV with its embedding drawn at a usual scale: its own init (orthogonal, gain 1e-4 x sqrt(vocab)) feeds
    `pre_ln` inputs ~1e-4 wide, whose normalisation multiplies the embedding's gradient (and the float32 round-off
    of the sharded sums beneath it) by ~3000, to ~1e-4 absolute on gradients of ~170 (the zoo's `round-off`)."""
    model = _family("rwkv")
    nn.init.normal_(model.rwkv.embeddings.weight, std=0.02)
    return model


def _doge(**overrides) -> nn.Module:
    """Doge with a random A: its init of zeros makes the dynamic mask a constant that no dt_proj split could move."""
    model = _family("doge", **overrides)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.A.copy_(torch.randn(layer.self_attn.A.shape))
    return model


MIXED = ["linear_attention", "full_attention"]
# name -> (build, forward, tps, block_rel_tol: matrices kept whole on purpose, a router or replicated kv heads)
CASES = {
    "electra": (lambda: _family("electra"), _hf_logits, (2,), 0.0),
    "phimoe_router_whole": (lambda: _family("phimoe"), _hf_logits, (2,), 0.01),
    "gpt_bigcode_multi_query": (lambda: _family("gpt_bigcode"), _hf_logits, (2, 4), 0.3),
    "gpt_bigcode_multi_head": (lambda: _family("gpt_bigcode", multi_query=False), _hf_logits, (2, 4), 0.0),
    "apertus_activation_scalars": (lambda: _family("apertus"), _hf_logits, (2,), 0.0),
    # HF's plan shards only the MLP and experts; V2's latent-attention entries are added (q_a, kv_a's norm whole).
    "deepseek_v3_latent_attention": (lambda: _family("deepseek_v3"), _hf_logits, (2,), 0.15),
    "inkling_style_embedding_and_shared_experts": (InklingStyleLM, _logits, (2,), 0.0),
    # Gated delta-net linear attention split by heads (`families.recurrent.DELTA_NET`): OLMo-Hybrid with twice
    # as many value heads as key heads (a conv1d over [q; k; v] of sections 32, 32, 64) beside its full attention
    # (Hugging Face's gathering plan); Kimi-Linear and Ling with a linear and a latent-attention layer (whose
    # latent projections stay whole), Kimi's low-rank gate projections whole.
    "olmo_hybrid_delta_net": (lambda: _family("olmo_hybrid", linear_num_value_heads=8), _hf_logits, (2, 4), 0.0),
    "kimi_linear_delta_net": (lambda: _family("kimi_linear", layer_types=MIXED), _hf_logits, (2, 4), 0.05),
    "bailing_hybrid_delta_net": (lambda: _family("bailing_hybrid", layer_types=MIXED), _hf_logits, (2, 4), 0.12),
    "mamba2_heads_and_groups": (lambda: _family("mamba2"), _hf_logits, (2, 4), 0.0),
    # its Mamba2 layer by the same entries, beside HF's expert plan (the tiny config: a Mamba2 and an MoE layer, no
    # attention layer, so no cache either)
    "nemotron_h_mamba2_layer": (lambda: _family("nemotron_h"), forward_without_cache_logits, (2,), 0.01),
    # Mamba layers only, whose cache its forward cannot build: called without one. One group (the tiny config keeps
    # the default, as real checkpoints have): its B and C (16 of in_proj's 168 rows each), and their conv channels,
    # on every rank (a quarter more than 1/tp of the block matrices at tp=4), its norm across them; two groups at
    # tp=4, each on two ranks.
    "bamba_one_group": (lambda: _family("bamba"), forward_without_cache_logits, (2, 4), 0.25),
    "bamba_two_groups": (lambda: _family("bamba", mamba_n_groups=2), forward_without_cache_logits, (4,), 0.16),
    "granitemoehybrid_one_group": (lambda: _family("granitemoehybrid"), forward_without_cache_logits, (2,), 0.05),
    # Falcon-H1: attention, a one-group Mamba2 mixer and an MLP in every layer; in_proj's output scaled by the
    # `mup_vector` buffer (the tiny config's μP multipliers differ per section), split with in_proj's sections.
    "falcon_h1_mup_vector": (lambda: _family("falcon_h1"), _hf_logits, (2, 4), 0.2),
    # Zamba: its Mamba mixers split by their 4 heads (x_proj, dt_proj, A_log and D along them), the shared block tied
    # across both hybrid layers, with 2 kv heads (replicated at tp 4: the tied k and v gradients summed over the
    # replicas once, not once per layer), down_proj's output reduce-scattered into the row-parallel `linear`.
    "zamba_mamba_heads_and_tied_block": (lambda: _family("zamba", num_key_value_heads=2), _hf_logits, (2, 4), 0.1),
    # Zamba2: a Mamba2 layer and two hybrid ones (one group: B and C on every rank, the gated norm across them), the
    # shared block tied across both with its per-layer adapters on q, k, v and gate_up_proj (up Linears split with
    # what they add to).
    "zamba2_mamba2_and_adapters": (
        lambda: _family(
            "zamba2",
            num_hidden_layers=3,
            layers_block_type=["linear_attention", "hybrid", "hybrid"],
            use_shared_attention_adapter=True,
            head_dim=16,  # its adapters' output is attention_hidden_size wide: q's width only with its own head_dim
        ),
        _hf_logits,
        (2, 4),
        0.31,  # the adapters' down Linears (64 x 8, 4 of them) whole, and the group's B and C: 0.325 at tp 4
    ),
    # BitNet's sub-norms over the attention output and act(gate) * up, between the column and the row layers, split
    # with the features and normalised over the whole width (`rmsnorm_parallel`, `tp_train.plan.deciding.resolve`).
    "bitnet_sub_norms": (lambda: _family("bitnet"), _hf_logits, (2, 4), 0.0),
    # RWKV's time-mix split by channels with its per-channel decay and bonus; the channel-mix's receptance (hidden x
    # hidden) whole, so a rank holds 0.563 of the tiny blocks' matrices (time_mix_* included) at tp 2, 0.345 at tp 4.
    "rwkv_channels": (_rwkv, forward_without_cache_logits, (2, 4), 0.38),
    # DBRX's 2-D expert weights split expert by expert (`colwise(32,32,32,32)`), the experts' view of ffn_hidden_size
    # local and their partial sums all-reduced; Wqkv head-aware with 2 kv heads (replicated at tp 4); the router whole.
    "dbrx_experts_and_fused_qkv": (lambda: _family("dbrx"), _hf_logits, (2, 4), 0.1),
    # RecurrentGemma's recurrent blocks split by the RG-LRU's heads (its 3-D block-diagonal gates along the heads),
    # beside a local-attention layer with the released configs' one kv head (replicated: the tolerance).
    "recurrent_gemma_rg_lru_heads": (
        lambda: _family("recurrent_gemma", num_hidden_layers=3, num_key_value_heads=1),
        _hf_logits,
        (2, 4),
        0.1,
    ),
    # Doge's dynamic mask: dt_proj's summed output kept per rank for its own kv heads (`rowwise_scatter_output`, its
    # bias split with them); with its CDMoE (HF's plan: the expert tables split by rows, the router gathered) at tp 2.
    "doge_dynamic_mask": (lambda: _doge(attention_bias=True), _hf_logits, (2, 4), 0.0),
    "doge_cdmoe": (lambda: _doge(is_moe=True, num_experts=16, num_experts_per_tok=4), _hf_logits, (2,), 0.0),
    # Inkling's attention on local heads: its depthwise short convolutions over the keys and values (read through
    # `conv1d.weight`; 2 kv heads wide in the full layer) split with the kv heads, its relative-position bank shared
    # by the heads whole, its gradient summed, as the MoE router (1% of the block matrices). (With 2 kv heads at tp 4
    # the auto-planner finds no split of k_proj.)
    "inkling_short_convolutions_gqa": (lambda: _family("inkling_text", num_key_value_heads=2), _hf_logits, (2,), 0.02),
    "inkling_short_convolutions": (lambda: _family("inkling_text"), _hf_logits, (4,), 0.04),
    # Inkling 2: the same, with per-head sinks (sink_proj) and gate split with the heads, the L2 clips' per-head
    # scales with them, and its full layer's dynamic short convolutions: their static taps (kernel, kv width) split
    # along the kv channels, their tap projections (weight_proj) by kv heads, their own `num_heads` made local.
    "inkling2_dynamic_convolutions": (lambda: _family("inkling2_text"), _hf_logits, (2,), 0.05),
    # gpt-oss with 2 kv heads (replicated at tp 4): attention on local heads with its sinks split with them, every
    # expert's interleaved gate/up and down split by its intermediate features, down_proj's bias counted once.
    "gpt_oss_sinks_and_experts": (lambda: _family("gpt_oss", num_key_value_heads=2), _hf_logits, (2, 4), 0.07),
    # CodeGen's four hard-coded [q; v; k] groups: each rank holds its share of every group's heads (qkv_proj by twelve
    # sections, out_proj by four), what its forward's reshape into four groups needs on local heads.
    "codegen_head_groups": (lambda: _family("codegen"), _hf_logits, (2, 4), 0.0),
    # xLSTM: its feed-forward gate's weight is initialised to zeros (silu(0) = 0 hides where proj_up's shares go) and
    # its mLSTM cell runs on local heads with its per-head norm (checking its head count) split with them. Called
    # without a cache: its cache, built from the model's config, holds every head's state (refused in its forward).
    "xlstm_zero_gate_and_mlstm_heads": (lambda: _family("xlstm"), forward_without_cache_logits, (2, 4), 0.0),
}


def _parameter_share(rank, world_size):
    """This rank's elements of every parameter over the model's, sharded with no plan given."""
    import tp_train
    from tp_train.parallel.sharding import full_numel

    model = _family("gpt_oss", num_key_value_heads=2)
    full = sum(param.numel() for param in model.parameters())
    tp_train.parallelize(model, verify=False)
    specs = {id(param): spec for _, param, spec in tp_train.named_sharded_parameters(model)}
    assert full == sum(full_numel(p, specs[id(p)]) if id(p) in specs else p.numel() for p in model.parameters())
    return sum(param.numel() for param in model.parameters()) / full


def test_gpt_oss_holds_at_most_0_6_of_its_parameters_per_rank_at_tp2():
    shares = run_on_ranks(_parameter_share, 2, timeout=300)
    assert all(share <= 0.6 for share in shares), shares


def test_recurrent_gemma_and_doge_plans():
    """Each of RecurrentGemma's temporal blocks gets its own kind's view; Doge's dt_proj keeps its heads' outputs."""
    plan, source = resolve_plan(_family("recurrent_gemma", num_hidden_layers=3), tensor_parallel_size=2)
    assert source == "the built-in preset for model_type 'recurrent_gemma'"
    assert plan["model.layers.0.temporal_block"] == "attention(lru_width, rg_lru.num_attention_heads)"
    assert plan["model.layers.2.temporal_block"] == "attention"
    assert plan["model.layers.*.temporal_block.rg_lru"] == "channelwise"
    plan, _ = resolve_plan(_family("doge"), tensor_parallel_size=2)
    assert plan["model.layers.*.self_attn.dt_proj"] == "rowwise_scatter_output"
    assert plan["model.layers.*.self_attn.A"] == "colwise"


def test_inklings_short_convolutions_split_with_the_kv_heads_they_convolve():
    """Each short convolution is as wide as k_proj's output (the kv heads, 2 of 8 in the full layer, 4 in the
    sliding one): split as k_proj splits it, so the attention runs on local heads rather than being kept whole."""
    plan, _ = resolve_plan(_family("inkling_text", num_key_value_heads=2), tensor_parallel_size=2)
    assert plan["model.layers.*.self_attn"] == "attention"
    assert plan["model.layers.0.self_attn.k_sconv.conv1d"] == "channelwise"  # 4 kv heads: as wide as the row input
    assert plan["model.layers.1.self_attn.v_sconv.conv1d"] == "channelwise(2x8)"
    assert plan["model.layers.*.self_attn.rel_logits_proj"] == "replicated_with_grad_allreduce"
    assert not plan.notes


def test_inkling2s_full_layer_views_its_convolutions_heads_locally():
    plan, _ = resolve_plan(_family("inkling2_text"), tensor_parallel_size=2)
    assert plan["model.layers.1.self_attn"] == "attention(num_heads, k_sconv.num_heads, v_sconv.num_heads)"
    assert plan["model.layers.*.self_attn.k_sconv.static_weight"] == "rowwise"  # along its last dim: the kv channels
    assert plan["model.layers.*.self_attn.sink_proj"] == "colwise"
    assert plan["model.layers.*.self_attn.rel_l2_clip.scale"] == "colwise"
    assert not plan.notes


def test_rowwise_scatter_output_needs_whole_outputs_per_rank():
    """Doge with 2 kv heads at tp 4: its kv heads would be replicated, and dt_proj's 2 outputs cannot be split."""
    from tp_train.plan.deciding.match import match_plan

    model = _family("doge", num_key_value_heads=2)
    plan, _ = resolve_plan(model, tensor_parallel_size=4)
    with pytest.raises(ValueError) as refusal:
        match_plan(model, plan, 4)
    message = str(refusal.value)
    assert "'model.layers.0.self_attn.dt_proj' (Linear): out_features=2 is not divisible" in message
    assert "\n" not in message


def _parity(rank, world_size):
    """Each case's errors, or the one line of a plan refused or verification failed (raised on every rank alike), so
    that one case failing fails only its own test."""
    from tp_train.errors import first_line

    results = {}
    for name, (build, forward, tps, _) in CASES.items():
        if world_size in tps:
            torch.manual_seed(0)
            try:
                results[name] = parity_errors(build(), forward, VOCAB)
            except ValueError as error:  # PlanVerificationError is one
                results[name] = f"{type(error).__name__}: {first_line(error)}"
    return results


_RESULTS: dict[int, list] = {}


def _results(tp: int) -> list:
    """Every case at `tp`, on one spawn of ranks (spawning dominates the cost); each case is its own test."""
    if tp not in _RESULTS:
        _RESULTS[tp] = run_on_ranks(_parity, tp, timeout=600)
    return _RESULTS[tp]


@pytest.mark.parametrize("name, tp", [(name, tp) for name, case in CASES.items() for tp in case[2]])
def test_the_family_shards_and_matches_unsharded(name, tp):
    for rank, results in enumerate(_results(tp)):
        if isinstance(results[name], str):
            pytest.fail(f"rank {rank}: {results[name]}")
        assert_parity(results[name], tp, rank, ATOL, block_rel_tol=CASES[name][3])


def test_codegens_attention_is_split_by_its_head_groups():
    """Its forward reshapes qkv_proj's output into four groups (`mp_num`) of [q; v; k] whatever the heads: the
    contiguous split gives each rank whole groups, which that reshape cuts wrongly, so the planner splits each group's
    q, v and k, and out_proj's input by the four groups' heads."""
    plan, _ = resolve_plan(_family("codegen"), tensor_parallel_size=2)
    assert plan["transformer.h.*.attn.qkv_proj"] == f"colwise({','.join(['8'] * 12)})"
    assert plan["transformer.h.*.attn.out_proj"] == "rowwise(8,8,8,8)"
    assert plan["transformer.h.*.attn"] == "attention" and not plan.notes


def test_xlstms_zero_gate_and_per_head_norm_are_planned():
    """Its feed-forward gate (weight zeros at initialisation, silu(0) = 0) would hide where proj_up's shares go: the
    other columns are moved in every probe; its mLSTM cell's view divides its per-head norm's head count, which the
    norm's forward checks."""
    plan, _ = resolve_plan(_family("xlstm"), tensor_parallel_size=2)
    assert plan["backbone.blocks.*.ffn.proj_up"] == "colwise" and plan["backbone.blocks.*.ffn.proj_down"] == "rowwise"
    view = plan["backbone.blocks.*.mlstm_layer"]  # the counts in the order the search tried them
    assert view.startswith("attention(") and set(view[len("attention(") : -1].split(", ")) == {
        "v_dim",
        "config.num_heads",
        "multihead_norm.num_heads",
    }
    assert plan["backbone.blocks.*.mlstm_layer.multihead_norm.weight"] == "colwise" and not plan.notes


def test_blts_cross_attention_is_planned_where_its_patches_are_longer_than_a_byte():
    """A patch querying one byte (every byte its own patch, as the random patcher makes them at the default
    threshold) shows nothing of its queries, and the cross-attention was refused; with the zoo's threshold above
    ln(vocab) its patches are long and its queries split by heads."""
    plan, _ = resolve_plan(_family("blt"), tensor_parallel_size=2)
    assert plan["model.local_encoder.cross_attn_layers.*.q_proj"] == "colwise"
    assert plan["model.local_encoder.cross_attn_layers.*.o_proj"] == "rowwise"
    assert not plan.notes


def test_a_head_width_a_config_keeps_per_layer_is_read_from_each_attention():
    """Gemma 4's text config keeps `head_dim` per layer (its full-attention layers are wider), and reading it as one
    value raises: the planner takes each attention's own head width and shards every block's attention and MLP."""
    from tp_train.plan.deciding.match import match_plan

    model = _family("gemma4_text")  # a sliding-window layer, then a full-attention one
    plan, _ = resolve_plan(model, tensor_parallel_size=2)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    counts = {entry.name: entry.counts for entry in match_plan(model, plan, 2) if entry.name.endswith("q_proj")}
    assert counts["model.layers.0.self_attn.q_proj"].head_dim == 8
    assert counts["model.layers.1.self_attn.q_proj"].head_dim == model.model.layers[1].self_attn.head_dim > 8


def _replicas_identical(model, optimizer, group) -> dict[str, bool]:
    """Whether each replicated section (parameters and AdamW moments) is bit-identical on the ranks sharing it."""
    from tp_train.parallel.sharding import named_sharded_parameters, replicated_rows

    world_size, identical = dist.get_world_size(group), {}
    for name, param, spec in named_sharded_parameters(model):
        for start, rows, copies in replicated_rows(spec, world_size):
            for label, tensor in (("", param.detach()), (":exp_avg", optimizer.state[param]["exp_avg"])):
                piece = tensor.narrow(spec.dim, start, rows).contiguous()
                everyone = [torch.empty_like(piece) for _ in range(world_size)]
                dist.all_gather(everyone, piece, group=group)
                same = all(torch.equal(everyone[r], everyone[r - r % copies]) for r in range(world_size))
                identical[f"{name}{label}@{start}"] = same
    return identical


CHECKPOINTED = {
    "mamba2": lambda: _family("mamba2", n_groups=2),  # 2 groups: B and C replicated on two ranks each at tp 4
    "doge": lambda: _doge(attention_bias=True),
    "recurrent_gemma": lambda: _family("recurrent_gemma", num_hidden_layers=3),  # an attention layer: a cache
}


def _checkpoints(rank, world_size, directory, train: bool, names):
    """Each family in `names` at this tp: trained 2 AdamW steps and saved (`train`), or built with other weights and
    loaded. Returns, per family, the full parameters and AdamW moments, the logits, and (trained) whether each
    replicated section is bit-identical on its replicas."""
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh

    import tp_train
    from tests.test_kv_replication import gathered_and_logits

    mesh = init_device_mesh("cpu", (world_size,))
    results = {}
    for name in names:
        torch.manual_seed(0 if train else 1)
        model = tp_train.parallelize(CHECKPOINTED[name](), mesh, verify=False)  # the parity cases verify the split
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        idx = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(5))
        identical = {}
        if train:
            for _ in range(2):
                F.cross_entropy(model(idx).logits.flatten(0, 1), idx.flatten()).backward()
                optimizer.step()
                optimizer.zero_grad()
            identical = _replicas_identical(model, optimizer, mesh.get_group())
            tp_train.save_checkpoint(Path(directory) / name, model, [optimizer], mesh)
        else:
            tp_train.load_checkpoint(Path(directory) / name, model, [optimizer], mesh)
        results[name] = (*gathered_and_logits(model, optimizer, mesh, idx), identical)
    return results


@pytest.mark.slow
@pytest.mark.parametrize(
    "names, split",
    [
        # sections ([z; x; B; C; dt], the conv's [x; B; C]) laid out per rank differently at each tp; 2 groups' B and
        # C replicated on two ranks each at tp 4 (bit-identical after training), whole at tp 2
        (("mamba2",), "conv1d"),
        # dt_proj's bias split with its outputs; the RG-LRU's 3-D gates split along their heads
        (("doge", "recurrent_gemma"), "dt_proj.bias"),
    ],
    ids=["mamba2", "doge_and_recurrent_gemma"],
)
def test_a_checkpoint_saved_at_tp4_loads_at_tp2(tmp_path, names, split):
    trained = run_on_ranks(_checkpoints, 4, str(tmp_path), True, names, timeout=300)[0]
    loaded = run_on_ranks(_checkpoints, 2, str(tmp_path), False, names, timeout=300)[0]
    assert any(split in parameter for parameter in trained[names[0]][0])
    if names == ("mamba2",):
        identical = trained["mamba2"][2]
        assert any("in_proj" in name for name in identical) and any("conv1d" in name for name in identical), identical
    for name in names:
        (parameters, logits, identical), (loaded_parameters, loaded_logits, _) = trained[name], loaded[name]
        assert all(identical.values()), (name, identical)
        assert loaded_parameters.keys() == parameters.keys()
        for parameter, tensor in parameters.items():
            assert torch.equal(loaded_parameters[parameter], tensor), (name, parameter)
        assert (loaded_logits - logits).abs().max().item() < ATOL, name
