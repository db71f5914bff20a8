"""Built-in plans for Hugging Face families whose configs ship no `base_model_tp_plan`, head-aware plans that replace
a wasteful one, and entries added where Hugging Face's plan leaves block matrices whole.

Keys are relative to the base model (as in Hugging Face's own plans); `preset_plan` prefixes them for a model
with a head and adds the head. Each preset is data; `tp_train.plan.apply` is what reads it.
"""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.mixer_presets import (
    BAILING_DELTA_NET,
    KIMI_DELTA_NET,
    OLMO_HYBRID_DELTA_NET,
    falcon_h1_layers,
    falcon_h1_unsupported,
    latent_and_delta_variant,
    mamba2_variant,
    mamba_layers,
    nemotron_h_variant,
    olmo_hybrid_variant,
    recurrent_gemma_variant,
    under,
)
from tp_train.plan.zamba_presets import zamba2_layers, zamba_layers

PRESETS: dict[str, dict[str, str]] = {
    # GPT-2: c_attn is a fused [q; k; v] Conv1D, so its split must be head-aware; the attention module keeps
    # split_size / num_heads / embed_dim as attributes; resid_dropout acts on the replicated residual stream.
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn": "attention",
        "h.*.attn.c_attn": "fused_qkv_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.attn.resid_dropout": "replicated_rng",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # GPT-J: separate q/k/v/out Linears (no bias); the attention forward splits heads with num_attention_heads
    # (embed_dim is only read in __init__); rotary acts within each head. attn_dropout (on the probabilities of the
    # local heads) runs in the sharded stream, resid_dropout (after out_proj, on the replicated stream) must not.
    # The MLP (fc_in/fc_out, with bias) runs in parallel with attention off the same ln_1 output.
    "gptj": {
        "wte": "embedding_rowwise",
        "h.*.attn": "attention",
        "h.*.attn.q_proj": "colwise",
        "h.*.attn.k_proj": "colwise",
        "h.*.attn.v_proj": "colwise",
        "h.*.attn.out_proj": "rowwise",
        "h.*.attn.resid_dropout": "replicated_rng",
        "h.*.mlp.fc_in": "colwise",
        "h.*.mlp.fc_out": "rowwise",
    },
    # GPT-Neo: h.*.attn is a wrapper; the attention itself is h.*.attn.attention (global or local window), which
    # views heads with num_heads. Separate q/k/v (no bias), out_proj with a bias; resid_dropout follows out_proj.
    "gpt_neo": {
        "wte": "embedding_rowwise",
        "h.*.attn.attention": "attention",
        "h.*.attn.attention.q_proj": "colwise",
        "h.*.attn.attention.k_proj": "colwise",
        "h.*.attn.attention.v_proj": "colwise",
        "h.*.attn.attention.out_proj": "rowwise",
        "h.*.attn.attention.resid_dropout": "replicated_rng",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
    # OPT: separate q/k/v/out Linears (biases by enable_bias), heads viewed with num_heads; the attention dropout is
    # applied to the probabilities inside the attention function (sharded stream); the residual dropouts live in
    # the decoder layer, outside the attention module. embed_positions stays replicated, and so do project_in /
    # project_out (present when word_embed_proj_dim != hidden_size, as in OPT-350m; tested).
    "opt": {
        "decoder.embed_tokens": "embedding_rowwise",
        "decoder.layers.*.self_attn": "attention",
        "decoder.layers.*.self_attn.q_proj": "colwise",
        "decoder.layers.*.self_attn.k_proj": "colwise",
        "decoder.layers.*.self_attn.v_proj": "colwise",
        "decoder.layers.*.self_attn.out_proj": "rowwise",
        "decoder.layers.*.fc1": "colwise",
        "decoder.layers.*.fc2": "rowwise",
    },
    # Falcon (rotary, multi_query=False, or new_decoder_architecture): query_key_value is laid out per head as
    # [q_h; k_h; v_h] (classic multi-head) or per kv group as [q_g1..q_gn; k_g; v_g] (new architecture), and the
    # forward views it with -1 heads/groups, so a plain contiguous colwise split hands each rank whole heads/groups
    # (fused_qkv_colwise, which assumes [q; k; v], would be wrong). num_heads and num_kv_heads become local.
    # Multi-query (one kv head, laid out [q_1..q_H; k; v]) is a fused [q; k; v] split, its one kv head held by
    # every rank (`CONFIG_VARIANTS`). ALiBi configs are refused by `_falcon_unsupported`.
    "falcon": {
        "word_embeddings": "embedding_rowwise",
        "h.*.self_attention": "attention",
        "h.*.self_attention.query_key_value": "colwise",
        "h.*.self_attention.dense": "rowwise",
        "h.*.mlp.dense_h_to_4h": "colwise",
        "h.*.mlp.dense_4h_to_h": "rowwise",
    },
    # Mamba2, as Megatron shards it: its mixer's entries are `mamba2_mixer`'s, their sections sized by the config
    # (`mamba2_variant`).
    "mamba2": {"embeddings": "embedding_rowwise"},
    # Zamba and Zamba2: Mamba layers, and hybrid layers running a shared transformer block before theirs; every entry
    # but the embedding is sized or placed by the config (`tp_train.plan.zamba_presets`).
    "zamba": {"embed_tokens": "embedding_rowwise"},
    "zamba2": {"embed_tokens": "embedding_rowwise"},
    # RecurrentGemma (Griffin): each layer's temporal block is local attention or a recurrent block; the entries of
    # both are given, and the config's layer kinds decide which match (`recurrent_gemma_variant` names each block's
    # own view). The recurrent block splits by the RG-LRU's heads: linear_x and linear_y by columns, the depthwise
    # conv_1d by channels, the RG-LRU's per-channel recurrent_param and its block-diagonal gates
    # ((heads, block_width, block_width) weights, (heads, block_width) biases) along dim 0 (`channelwise`: each
    # rank's heads are its contiguous channels), linear_out by rows. The attention (one kv head in the released
    # configs, replicated when tp exceeds it) and the MLP as Llama's.
    "recurrent_gemma": {
        "embed_tokens": "embedding_rowwise",
        "layers.*.temporal_block.linear_x": "colwise",
        "layers.*.temporal_block.linear_y": "colwise",
        "layers.*.temporal_block.conv_1d": "channelwise",
        "layers.*.temporal_block.rg_lru": "channelwise",
        "layers.*.temporal_block.linear_out": "rowwise",
        "layers.*.temporal_block.q_proj": "colwise",
        "layers.*.temporal_block.k_proj": "colwise",
        "layers.*.temporal_block.v_proj": "colwise",
        "layers.*.temporal_block.o_proj": "rowwise",
        "layers.*.mlp_block.gate_proj": "colwise",
        "layers.*.mlp_block.up_proj": "colwise",
        "layers.*.mlp_block.down_proj": "rowwise",
    },
}
# GPT-BigCode: c_attn is [q (all heads); k; v] with one kv head (multi_query, the default), which every rank
# then holds (`fused_qkv_colwise`, kv-head replication); without multi_query it is laid out per head as
# [q_h; k_h; v_h] and viewed with num_heads, so a contiguous split hands each rank whole heads (`CONFIG_VARIANTS`).
# The attention keeps embed_dim / num_heads / kv_heads / num_key_value_groups, made local by `attention`. Its
# module names are GPT-2's, and so is its plan.
PRESETS["gpt_bigcode"] = PRESETS["gpt2"]
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
# BitNet: Llama's blocks with an RMS norm between each column and row layer, over the full width the column split
# divides (`attn_sub_norm` on the attention output before o_proj, `ffn_sub_norm` on act(gate) * up before
# down_proj): `rmsnorm_parallel` splits its weight with those features and normalises over all of them. The
# attention views heads with -1 and keeps only the ratio of query to kv heads, so it needs no `attention` entry.
PRESETS["bitnet"] = {
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

# RWKV (v4): the time-mix (attention) splits by channels: key, value and receptance by columns, the per-channel decay
# and bonus (`time_decay`, `time_first`) with them (the wkv recurrence acts on each channel on its own), output by
# rows. The channel-mix (feed-forward) splits key by columns and value by rows; its receptance (hidden -> hidden,
# whose sigmoid gates the value layer's all-reduced output) stays whole, as do the time_mix_* interpolations of the
# replicated input. Its LM head is `head` (split over the vocabulary, as `lm_head` is).
PRESETS["rwkv"] = {
    "embeddings": "embedding_rowwise",
    "blocks.*.attention.key": "colwise",
    "blocks.*.attention.value": "colwise",
    "blocks.*.attention.receptance": "colwise",
    "blocks.*.attention.time_decay": "colwise",
    "blocks.*.attention.time_first": "colwise",
    "blocks.*.attention.output": "rowwise",
    "blocks.*.feed_forward.key": "colwise",
    "blocks.*.feed_forward.receptance": "replicate",
    "blocks.*.feed_forward.value": "rowwise",
}


# Plans that replace Hugging Face's own where it is wasteful. phi3's fused qkv_proj ([q; k; v], k and v with the kv
# heads' width) and gate_up_proj ([gate; up]) are gathered whole and re-split under HF's plan (`colwise_gather_output`
# then `rowwise_split_input`: two all-gathers and an all-reduce per block, every head on every rank); split head-aware
# instead, each attention and each MLP costs one all-reduce. The attention reads its head counts from its config,
# which the `attention` style gives it a local copy of.
HEAD_AWARE_OVERRIDES: dict[str, dict[str, str]] = {
    "phi3": {
        "embed_tokens": "embedding_rowwise",
        "layers.*.self_attn": "attention",
        "layers.*.self_attn.qkv_proj": "fused_qkv_colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_up_proj": "packed_colwise",
        "layers.*.mlp.down_proj": "rowwise",
    },
}

# Entries added to (or corrected in) Hugging Face's plan where it leaves a block's matrices whole on every rank:
# Qwen2-MoE's plan names the dense MLP and the routed experts but not the shared expert beside them. Apertus's MLP
# activation (xIELU) holds learned scalars that act on each rank's share of the hidden features, between up_proj and
# down_proj: their gradients are partial sums, which HF's plan leaves unsummed.
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
# split over ranks (Megatron's column-then-row split of every expert; sections sized per config in
# `CONFIG_VARIANTS`), the view made local, and the experts' partial sums all-reduced once (`moe_tp_experts`). The
# router stays whole.
DBRX = {
    "wte": "embedding_rowwise",
    "blocks.*.norm_attn_norm.attn": "attention(num_heads, num_key_value_heads, hidden_size)",
    "blocks.*.norm_attn_norm.attn.Wqkv": "fused_qkv_colwise",
    "blocks.*.norm_attn_norm.attn.out_proj": "rowwise",
    "blocks.*.ffn.experts": "moe_tp_experts(ffn_hidden_size)",
}

ADDITIONS: dict[str, dict[str, str]] = {
    "dbrx": DBRX,
    "gpt_oss": GPT_OSS,
    "deepseek_v3": LATENT_ATTENTION,
    "olmo_hybrid": under("layers.*.linear_attn", OLMO_HYBRID_DELTA_NET),
    # Kimi-Linear's and Ling's full-attention layers are DeepSeek's latent attention, under the same name.
    "kimi_linear": {**LATENT_ATTENTION, **under("layers.*.self_attn", KIMI_DELTA_NET)},
    "bailing_hybrid": {**LATENT_ATTENTION, **under("layers.*.self_attn", BAILING_DELTA_NET)},
    "youtu": LATENT_ATTENTION,
    "apertus": {"layers.*.mlp.act_fn": "replicated_with_grad_allreduce"},
    # Doge's attention masks each kv head's scores dynamically from dt_proj, which maps every head's values (the
    # full value width) to one output per kv head: with v split by kv heads, each rank's dt_proj holds its heads'
    # input rows and needs only its own heads' outputs, so HF's `rowwise` (every head's output on every rank, the
    # mask then broadcast against the local heads) is corrected to `rowwise_scatter_output`; the per-kv-head A is
    # split with the heads, and the attention's dropout draws from the sharded stream. Its QK-norms (over each head's
    # width, shared by all heads) stay whole with their gradients summed over the ranks' heads.
    "doge": {
        "layers.*.self_attn": "attention",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.dt_proj": "rowwise_scatter_output",
        "layers.*.self_attn.A": "colwise",
    },
    # ESM C's QK-LayerNorms normalise over q's and k's whole width (every head's features), between the column
    # projections HF's plan splits and o_proj: each normalises this rank's share over every rank's features
    # (`layernorm_parallel`), as the auto-planner, given no plan, plans them too.
    "esmc": {"layers.*.self_attn.q_norm": "layernorm_parallel", "layers.*.self_attn.k_norm": "layernorm_parallel"},
    # NeoMME's exclusive self-attention removes from each head's output its projection on the head's value, scaled
    # by a per-head `alpha` (heads,): split with the heads. Its value embeddings, an (vocab, kv_heads x head_dim) table
    # added to the values of the first and last global layers, are split with v_proj's kv heads (`CONFIG_VARIANTS`).
    "neomme": {"layers.*.self_attn.exclusive_self_attention.alpha": "colwise"},
    # Corrections: Inkling's fused expert weights are [gate; up] halves (`chunk(2)` in the experts' forward), which
    # HF's plan splits `colwise` (rank 0 would hold every gate, rank 1 every up): split half by half.
    "inkling_text": {"layers.*.mlp.experts.gate_up_proj": "packed_colwise"},
    "inkling2_text": {"layers.*.mlp.experts.gate_up_proj": "packed_colwise"},
    "qwen2_moe": {
        "layers.*.mlp.shared_expert.gate_proj": "colwise",
        "layers.*.mlp.shared_expert.up_proj": "colwise",
        "layers.*.mlp.shared_expert.down_proj": "rowwise",
    },
}


def _falcon_unsupported(model: nn.Module) -> str | None:
    if getattr(model.config, "alibi", False):
        return (
            "ALiBi biases are built for all heads in FalconModel and not sliced to each rank's heads; "
            "use a rotary config (alibi=False)"
        )
    return None


def _xlnet_unsupported(model: nn.Module) -> str | None:
    return (
        "its relative attention sums its heads through `o` and adds the residual and layer norm in one method "
        "(XLNetRelativeAttention.post_attention, no module), so no all-reduce can come between; its attention would "
        "stay whole on every rank (0.80 of it) and is refused instead: use data parallelism for XLNet"
    )


def _falcon_variant(config) -> dict[str, str]:
    if getattr(config, "multi_query", False) and not getattr(config, "new_decoder_architecture", False):
        return {"h.*.self_attention.query_key_value": "fused_qkv_colwise"}
    return {}


def _gpt_bigcode_variant(config) -> dict[str, str]:
    return {} if getattr(config, "multi_query", True) else {"h.*.attn.c_attn": "colwise"}


def _dbrx_experts(config) -> dict[str, str]:
    """Each of DBRX's expert weights split expert by expert: one section of ffn_hidden_size rows per expert."""
    sections = ",".join([str(config.ffn_config.ffn_hidden_size)] * config.ffn_config.moe_num_experts)
    return {f"blocks.*.ffn.experts.mlp.{weight}": f"colwise({sections})" for weight in ("w1", "v1", "w2")}


def _neomme_value_embeddings(config) -> dict[str, str]:
    """NeoMME's value-embedding table split along its columns by kv heads, as v_proj's output is (whole heads; each
    held by tp / kv_heads ranks when fewer than tp)."""
    return {"value_embeddings.weight": f"colwise({config.num_key_value_heads}x{config.head_dim})"}


# Models of a family that its preset (or its additions to Hugging Face's plan) cannot shard correctly (a config,
# or how it was built): model_type -> model -> the reason, or None.
UNSUPPORTED_CONFIGS = {"falcon": _falcon_unsupported, "falcon_h1": falcon_h1_unsupported, "xlnet": _xlnet_unsupported}
# Families no plan of tp_train's shards: refused whatever plans them (but an explicit plan).
UNSHARDABLE = ("xlnet",)
# Entries of a family's preset, or of its additions to Hugging Face's plan, that a config decides: model_type ->
# config -> the entries that replace or join the preset's or the additions'. Bamba's, GraniteMoeHybrid's and
# Nemotron-H's plans shard only the head or the experts, and Falcon-H1 ships none: their Mamba2 mixers are added,
# and the auto-planner completes attention and the MLPs.
CONFIG_VARIANTS = {
    "dbrx": _dbrx_experts,
    "falcon": _falcon_variant,
    "gpt_bigcode": _gpt_bigcode_variant,
    "mamba2": mamba2_variant,
    "recurrent_gemma": recurrent_gemma_variant,
    "olmo_hybrid": olmo_hybrid_variant,
    "kimi_linear": latent_and_delta_variant,
    "bailing_hybrid": latent_and_delta_variant,
    "nemotron_h": nemotron_h_variant,
    "bamba": mamba_layers,
    "granitemoehybrid": mamba_layers,
    "falcon_h1": falcon_h1_layers,
    "neomme": _neomme_value_embeddings,
    "zamba": zamba_layers,
    "zamba2": zamba2_layers,
}

HEAD_STYLE = "colwise_gather_output"  # the LM head: split over the vocabulary, its logits gathered


def preset_plan(model: nn.Module) -> dict[str, str] | None:
    """The preset for `model.config.model_type`, with keys as `model`'s module names; None when there is none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = PRESETS.get(model_type)
    if base is None:
        return None
    _check_supported(model_type, model, "preset")
    return _for_model(model, {**base, **_variant(model_type, model.config)}, head=True)


def check_shardable(model: nn.Module) -> None:
    """Raises a one-line `ValueError` for a model of a family tp_train cannot shard (`UNSHARDABLE`)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in UNSHARDABLE:
        _check_supported(model_type, model, "planner")


def _check_supported(model_type: str, model: nn.Module, what: str) -> None:
    check = UNSUPPORTED_CONFIGS.get(model_type)
    reason = check(model) if check else None
    if reason:
        raise ValueError(f"the built-in '{model_type}' {what} cannot shard this model: {reason}")


def _variant(model_type: str, config) -> dict[str, str]:
    variant = CONFIG_VARIANTS.get(model_type)
    return variant(config) if variant else {}


def override_plan(model: nn.Module) -> dict[str, str] | None:
    """The head-aware plan that replaces Hugging Face's for `model`'s family (`HEAD_AWARE_OVERRIDES`), or None."""
    base = HEAD_AWARE_OVERRIDES.get(getattr(getattr(model, "config", None), "model_type", None))
    return _for_model(model, base, head=True) if base else None


def plan_additions(model: nn.Module) -> dict[str, str]:
    """Entries to add to Hugging Face's plan for `model`'s family (`ADDITIONS`, and `CONFIG_VARIANTS` for a family
    without a preset), keyed as `model`'s modules."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = dict(ADDITIONS.get(model_type, {}))
    if model_type not in PRESETS:
        _check_supported(model_type, model, "plan additions")
        base |= _variant(model_type, model.config)
    return _for_model(model, base, head=False) if base else {}


def _for_model(model: nn.Module, base: dict[str, str], head: bool) -> dict[str, str]:
    """`base` (keys relative to the base model) keyed as `model`'s module names, with the LM head when `head`."""
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        plan = {f"{prefix}.{pattern}": style for pattern, style in base.items()}
    else:
        plan = dict(base)
    if head and (name := _head_name(model)):
        plan[name] = HEAD_STYLE
    return plan


def _head_name(model: nn.Module) -> str | None:
    """The name of `model`'s LM head when it is a Linear: `lm_head`, or whatever module the model says its output
    embeddings are (RWKV's `head`)."""
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "lm_head"
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        return None
    return next((name for name, module in model.named_modules() if module is head), None)
