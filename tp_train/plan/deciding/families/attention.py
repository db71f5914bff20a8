"""Records of families whose blocks are attention and an MLP (or experts): presets for configs that ship no
`base_model_tp_plan`, a head-aware plan replacing a wasteful one, and entries added where Hugging Face's plan leaves
block matrices whole."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.deciding.families.spec import FamilySpec

# GPT-2: c_attn is a fused [q; k; v] Conv1D, split head-aware; resid_dropout acts on the replicated stream
# (docs/hugging-face.md, "What the built-in records split").
GPT2 = {
    "wte": "embedding_rowwise",
    "h.*.attn": "attention",
    "h.*.attn.c_attn": "fused_qkv_colwise",
    "h.*.attn.c_proj": "rowwise",
    "h.*.attn.resid_dropout": "replicated_rng",
    "h.*.mlp.c_fc": "colwise",
    "h.*.mlp.c_proj": "rowwise",
}
# GPT-J: separate q/k/v/out Linears, heads viewed with num_attention_heads; resid_dropout (after out_proj) on the
# replicated stream.
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
# GPT-Neo: the attention is the wrapper h.*.attn's `attention`, heads viewed with num_heads.
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
# OPT: separate q/k/v/out Linears; embed_positions and project_in / project_out stay replicated.
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
# Falcon: query_key_value is laid out per head or per kv group, so a contiguous colwise hands each rank whole heads
# or groups; multi-query is a fused [q; k; v] (`_falcon_variant`); ALiBi is refused.
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


# GPT-BigCode: GPT-2's names and plan; without multi_query its c_attn is laid out per head, split plainly.
def _gpt_bigcode_variant(config) -> dict[str, str]:
    return {} if getattr(config, "multi_query", True) else {"h.*.attn.c_attn": "colwise"}


# BitNet: Llama's blocks with an RMS norm between each column and row layer, over the width the column split divides.
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
# phi3: its fused qkv_proj and gate_up_proj split head-aware in place of HF's gather and re-split.
PHI3 = {
    "embed_tokens": "embedding_rowwise",
    "layers.*.self_attn": "attention",
    "layers.*.self_attn.qkv_proj": "fused_qkv_colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_up_proj": "packed_colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
# gpt-oss: attention by local heads with its sinks; fused 3-D experts split per expert (Megatron's column-then-row),
# their partial sums all-reduced once, down_proj's bias counted once; the router whole.
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
# DeepSeek-V2's latent attention entries, for DeepSeek-V3 and Youtu whose plans shard only the MLP and experts.
LATENT_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}
# DBRX: Wqkv head-aware, its view making `hidden_size` (q's width) local; each expert's ffn rows split over the ranks
# (`_dbrx_experts`), the partial sums all-reduced once; the router whole.
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


# Doge: dt_proj (every head's values -> one output per kv head) keeps each rank's own heads' outputs
# (`rowwise_scatter_output`, correcting HF's `rowwise`); A with the heads; the QK-norms whole with summed gradients.
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


# Inkling: its sliding layers' own head counts and relative-position bank, at tiny sizes for the zoo; its fused
# [gate; up] experts split half by half (HF's `colwise` would give rank 0 every gate).
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
    # its latent attention repeats keys by num_attention_heads // num_key_value_heads yet makes one per query head:
    # None is the config's own "as many as query heads" (the generic 2 kv heads ran at no tp, issue 41)
    FamilySpec(model_type="deepseek_v3", additions=LATENT_ATTENTION, zoo_fields=dict(num_key_value_heads=None)),
    FamilySpec(model_type="youtu", additions=LATENT_ATTENTION),
    # the zoo sets rope_theta and clip_qkv, which every DBRX checkpoint sets and the defaults leave out
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
    # Apertus: xIELU's learned scalars act on each rank's share of the hidden features (partial-sum gradients)
    FamilySpec(model_type="apertus", additions={"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"}),
    FamilySpec(model_type="doge", additions=DOGE),
    # ESM C: the QK-LayerNorms normalise over q's and k's whole width, between column projections and o_proj
    FamilySpec(
        model_type="esmc",
        additions={f"layers.*.self_attn.{norm}": "layernorm_parallel" for norm in ("q_norm", "k_norm")},
    ),
    # NeoMME: the exclusive self-attention's per-head alpha splits with the heads, the value embeddings with v_proj
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
