"""Records of families whose blocks are attention and an MLP (or experts): presets for configs that ship no
`base_model_tp_plan`, a head-aware plan replacing a wasteful one, and entries added where Hugging Face's plan leaves
block matrices whole."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.families.spec import FamilySpec

# GPT-2: c_attn is a fused [q; k; v] Conv1D, so its split must be head-aware; the attention module keeps
# split_size / num_heads / embed_dim as attributes; resid_dropout acts on the replicated residual stream.
GPT2 = {
    "wte": "embedding_rowwise",
    "h.*.attn": "attention",
    "h.*.attn.c_attn": "fused_qkv_colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.attn.resid_dropout": "replicated_rng",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
# GPT-J: separate q/k/v/out Linears (no bias); the attention forward splits heads with num_attention_heads
# (embed_dim is only read in __init__); rotary acts within each head. attn_dropout (on the probabilities of the
# local heads) runs in the sharded stream, resid_dropout (after out_proj, on the replicated stream) must not.
# The MLP (fc_in/fc_out, with bias) runs in parallel with attention off the same ln_1 output.
GPTJ = {
    "wte": "embedding_rowwise",
    "h.*.attn": "attention",
    "h.*.attn.q_proj": "colwise",
    "h.*.attn.k_proj": "colwise",
    "h.*.attn.v_proj": "colwise",
    "h.*.attn.out_proj": "rowwise",
    "h.*.attn.resid_dropout": "replicated_rng",
    "h.*.mlp.fc_in": "colwise",
    "h.*.mlp.fc_out": "rowwise",
}
# GPT-Neo: h.*.attn is a wrapper; the attention itself is h.*.attn.attention (global or local window), which
# views heads with num_heads. Separate q/k/v (no bias), out_proj with a bias; resid_dropout follows out_proj.
GPT_NEO = {
    "wte": "embedding_rowwise",
    "h.*.attn.attention": "attention",
    "h.*.attn.attention.q_proj": "colwise",
    "h.*.attn.attention.k_proj": "colwise",
    "h.*.attn.attention.v_proj": "colwise",
    "h.*.attn.attention.out_proj": "rowwise",
    "h.*.attn.attention.resid_dropout": "replicated_rng",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
# OPT: separate q/k/v/out Linears (biases by enable_bias), heads viewed with num_heads; the attention dropout is
# applied to the probabilities inside the attention function (sharded stream); the residual dropouts live in
# the decoder layer, outside the attention module. embed_positions stays replicated, and so do project_in /
# project_out (present when word_embed_proj_dim != hidden_size, as in OPT-350m; tested).
OPT = {
    "decoder.embed_tokens": "embedding_rowwise",
    "decoder.layers.*.self_attn": "attention",
    "decoder.layers.*.self_attn.q_proj": "colwise",
    "decoder.layers.*.self_attn.k_proj": "colwise",
    "decoder.layers.*.self_attn.v_proj": "colwise",
    "decoder.layers.*.self_attn.out_proj": "rowwise",
    "decoder.layers.*.fc1": "colwise",
    "decoder.layers.*.fc2": "rowwise",
}
# Falcon (rotary, multi_query=False, or new_decoder_architecture): query_key_value is laid out per head as
# [q_h; k_h; v_h] (classic multi-head) or per kv group as [q_g1..q_gn; k_g; v_g] (new architecture), and the
# forward views it with -1 heads/groups, so a plain contiguous colwise split hands each rank whole heads/groups
# (fused_qkv_colwise, which assumes [q; k; v], would be wrong). num_heads and num_kv_heads become local.
# Multi-query (one kv head, laid out [q_1..q_H; k; v]) is a fused [q; k; v] split, its one kv head held by
# every rank (`_falcon_variant`). ALiBi configs are refused by `_falcon_unsupported`.
FALCON = {
    "word_embeddings": "embedding_rowwise",
    "h.*.self_attention": "attention",
    "h.*.self_attention.query_key_value": "colwise",
    "h.*.self_attention.dense": "rowwise",
    "h.*.mlp.dense_h_to_4h": "colwise",
    "h.*.mlp.dense_4h_to_h": "rowwise",
}


def _falcon_variant(config) -> dict[str, str]:
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return {"h.*.self_attention.query_key_value": "fused_qkv_colwise"}
    return {}


def _falcon_unsupported(model: nn.Module) -> str | None:
    if getattr(model.config, "alibi", False):
        return (
            "ALiBi biases are built for all heads in FalconModel and not sliced to each rank's heads; "
            "use a rotary config (alibi=False)"
        )
    return None


# GPT-BigCode: c_attn is [q (all heads); k; v] with one kv head (multi_query, the default), which every rank
# then holds (`fused_qkv_colwise`, kv-head replication); without multi_query it is laid out per head as
# [q_h; k_h; v_h] and viewed with num_heads, so a contiguous split hands each rank whole heads (`_gpt_bigcode_variant`).
# The attention keeps embed_dim / num_heads / kv_heads / num_key_value_groups, made local by `attention`. Its
# module names are GPT-2's, and so is its plan.
def _gpt_bigcode_variant(config) -> dict[str, str]:
    return {} if getattr(config, "multi_query", True) else {"h.*.attn.c_attn": "colwise"}


# BitNet: Llama's blocks with an RMS norm between each column and row layer, over the full width the column split
# divides (`attn_sub_norm` on the attention output before o_proj, `ffn_sub_norm` on act(gate) * up before
# down_proj): `rmsnorm_parallel` splits its weight with those features and normalises over all of them. The
# attention views heads with -1 and keeps only the ratio of query to kv heads, so it needs no `attention` entry.
BITNET = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.attn_sub_norm": "rmsnorm_parallel",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.ffn_sub_norm": "rmsnorm_parallel",
    "layers.*.mlp.down_proj": "rowwise",
}
# phi3's fused qkv_proj ([q; k; v], k and v with the kv heads' width) and gate_up_proj ([gate; up]) are gathered
# whole and re-split under HF's plan (`colwise_gather_output` then `rowwise_split_input`: two all-gathers and an
# all-reduce per block, every head on every rank); split head-aware instead (an override), each attention and each
# MLP costs one all-reduce. The attention reads its head counts from its config, which the `attention` style gives it
# a local copy of.
PHI3 = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn": "attention",
    "layers.*.self_attn.qkv_proj": "fused_qkv_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# gpt-oss: Hugging Face's plan is for expert parallelism only (its tensor-parallel plan names the head alone).
# Attention runs on local heads, its per-head attention sinks (`s_aux`, one logit per query head) split with them.
# The experts keep fused 3-D weights laid out (experts, in, out), gate and up interleaved along gate_up_proj's last
# dim (`is_concatenated = False`): every expert's intermediate features are split across ranks (Megatron's
# column-then-row split of each expert), gate_up_proj and its bias along that last dim (pairs kept together),
# down_proj along its intermediate dim, and the experts' partial sums all-reduced once (`moe_tp_experts`);
# down_proj's bias, added to every expert's output, counts once (`replicate_once`). The router stays whole.
GPT_OSS = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn": "attention",
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.sinks": "colwise",
    "layers.*.mlp.experts": "moe_tp_experts",
    "layers.*.mlp.experts.gate_up_proj": "packed_rowwise",
    "layers.*.mlp.experts.gate_up_proj_bias": "packed_rowwise",
    "layers.*.mlp.experts.down_proj": "colwise",
    "layers.*.mlp.experts.down_proj_bias": "replicate_once",
}
# DeepSeek-V3's and Youtu's plans shard only the MLP and the experts; their attention is DeepSeek-V2's latent
# attention (the same modules), so they take the attention entries of V2's plan: q_b (or q without a q LoRA) and
# kv_b split by heads, the kv latent projection split as `mla_kv_a_proj`, o_proj by rows, q_a kept whole.
LATENT_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
# DBRX: Hugging Face's plan shards only the head. Its attention's Wqkv is a fused [q; k; v] with kv_n_heads kv heads
# (split head-aware, the kv heads replicated when fewer than ranks); the attention splits q from k and v by its
# `hidden_size` (q's width), so its view makes that local with the head counts. Its experts keep w1, v1 and w2 as 2-D
# (experts x ffn_hidden_size, hidden) weights, viewed per expert with `ffn_hidden_size`: each expert's ffn rows are
# split over ranks (Megatron's column-then-row split of every expert; sections sized per config by `_dbrx_experts`),
# the view made local, and the experts' partial sums all-reduced once (`moe_tp_experts`). The router stays whole.
DBRX = {
    "wte": "embedding_rowwise",
    "blocks.*.norm_attn_norm.attn": "attention(num_heads, num_key_value_heads, hidden_size)",
    "blocks.*.norm_attn_norm.attn.Wqkv": "fused_qkv_colwise",
    "blocks.*.norm_attn_norm.attn.out_proj": "rowwise",
    "blocks.*.ffn.experts": "moe_tp_experts(ffn_hidden_size)",
}


def _dbrx_experts(config) -> dict[str, str]:
    """Each of DBRX's expert weights split expert by expert: one section of ffn_hidden_size rows per expert."""
    sections = ",".join([str(config.ffn_config.ffn_hidden_size)] * config.ffn_config.moe_num_experts)
    return {f"blocks.*.ffn.experts.mlp.{weight}": f"colwise({sections})" for weight in ("w1", "v1", "w2")}


# Doge's attention masks each kv head's scores dynamically from dt_proj, which maps every head's values (the full
# value width) to one output per kv head: with v split by kv heads, each rank's dt_proj holds its heads' input rows
# and needs only its own heads' outputs, so HF's `rowwise` (every head's output on every rank, the mask then
# broadcast against the local heads) is corrected to `rowwise_scatter_output`; the per-kv-head A is split with the
# heads, and the attention's dropout draws from the sharded stream. Its QK-norms (over each head's width, shared by
# all heads) stay whole with their gradients summed over the ranks' heads.
DOGE = {
    "layers.*.self_attn": "attention",
    "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
    "layers.*.self_attn.dt_proj": "rowwise_scatter_output",
    "layers.*.self_attn.A": "colwise",
}


def _neomme_value_embeddings(config) -> dict[str, str]:
    """NeoMME's value-embedding table split along its columns by kv heads, as v_proj's output is (whole heads; each
    held by tp / kv_heads ranks when fewer than tp)."""
    return {"value_embeddings.weight": f"colwise({config.num_key_value_heads}x{config.head_dim})"}


# Inkling's sliding-window layers keep head counts and widths of their own (64 heads of 128 by default, kept at the
# tiny sizes by no generic field), and a relative-position bank (d_rel x rel_extent, 16 x 1024) shared by the heads:
# the zoo builds a tiny sliding and a tiny full layer, a bank shorter than the input so its distance cut-off shows.
# Its fused expert weights are [gate; up] halves (`chunk(2)` in the experts' forward), which HF's plan splits
# `colwise` (rank 0 would hold every gate, rank 1 every up): corrected to split half by half.
INKLING = dict(
    additions={"layers.*.mlp.experts.gate_up_proj": "packed_colwise"},
    zoo_fields=dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=5, rel_extent=6)
    | dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8),
)

RECORDS = (
    FamilySpec(model_type="gpt2", preset=GPT2),
    FamilySpec(model_type="gpt_bigcode", preset=GPT2, variant=_gpt_bigcode_variant),
    FamilySpec(model_type="gptj", preset=GPTJ),
    # the zoo's two tiny layers: one (global, local) pair
    FamilySpec(model_type="gpt_neo", preset=GPT_NEO, zoo_fields=dict(attention_types=[[["global", "local"], 1]])),
    FamilySpec(model_type="opt", preset=OPT),
    FamilySpec(model_type="falcon", preset=FALCON, variant=_falcon_variant, unsupported=_falcon_unsupported),
    FamilySpec(model_type="bitnet", preset=BITNET),
    FamilySpec(model_type="phi3", override=PHI3),
    FamilySpec(model_type="gpt_oss", additions=GPT_OSS),
    FamilySpec(model_type="deepseek_v3", additions=LATENT_ATTENTION),
    FamilySpec(model_type="youtu", additions=LATENT_ATTENTION),
    # The zoo sets what every DBRX checkpoint does and its defaults leave out: attention reads
    # attn_config.rope_theta and clamps q/k/v by clip_qkv; the experts' width follows `d_model` only by that name.
    FamilySpec(
        model_type="dbrx",
        additions=DBRX,
        variant=_dbrx_experts,
        zoo_fields=dict(
            d_model=32,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
        ),
    ),
    # Apertus's MLP activation (xIELU) holds learned scalars that act on each rank's share of the hidden features,
    # between up_proj and down_proj: their gradients are partial sums, which HF's plan leaves unsummed.
    FamilySpec(model_type="apertus", additions={"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}),
    FamilySpec(model_type="doge", additions=DOGE),
    # ESM C's QK-LayerNorms normalise over q's and k's whole width (every head's features), between the column
    # projections HF's plan splits and o_proj: each normalises this rank's share over every rank's features
    # (`layernorm_parallel`), as the auto-planner, given no plan, plans them too.
    FamilySpec(
        model_type="esmc",
        additions={f"layers.*.self_attn.{norm}": "layernorm_parallel" for norm in ("q_norm", "k_norm")},
    ),
    # NeoMME's exclusive self-attention removes from each head's output its projection on the head's value, scaled by
    # a per-head `alpha` (heads,): split with the heads. Its value embeddings, an (vocab, kv_heads x head_dim) table
    # added to the values of the first and last global layers, are split with v_proj's kv heads.
    FamilySpec(
        model_type="neomme",
        additions={"layers.*.self_attn.exclusive_self_attention.alpha": "colwise"},
        variant=_neomme_value_embeddings,
    ),
    FamilySpec(model_type="inkling_text", **INKLING),
    FamilySpec(model_type="inkling2_text", **INKLING),  # the same layout (its sliding layers: 48 heads of 128)
    # Qwen2-MoE's plan names the dense MLP and the routed experts but not the shared expert beside them.
    FamilySpec(
        model_type="qwen2_moe",
        additions={
            "layers.*.mlp.shared_expert.gate_proj": "colwise",
            "layers.*.mlp.shared_expert.up_proj": "colwise",
            "layers.*.mlp.shared_expert.down_proj": "rowwise",
        },
    ),
    FamilySpec(
        model_type="xlnet",
        unshardable=(
            "its relative attention sums its heads through `o` and adds the residual and layer norm in one method "
            "(XLNetRelativeAttention.post_attention, no module), so no all-reduce can come between; its attention "
            "would stay whole on every rank (0.80 of it) and is refused instead: use data parallelism for XLNet"
        ),
    ),
)
