"""Records of the families that run a recurrent mixer in place of (or beside) attention: gated delta-net linear
attention, Mamba2 (Megatron's split), Griffin's recurrent blocks and RWKV. Each mixer's entries are data, sized per
config where its sections depend on it (a record's `variant`)."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.deciding.families.attention import LATENT_ATTENTION
from tp_train.plan.deciding.families.spec import FamilySpec

# Gated delta-net linear attention (OLMo-Hybrid's `linear_attn`, Kimi-Linear's and Ling's linear `self_attn`), which
# Hugging Face's plans leave whole, split by heads (docs/own-models.md, "The whole style vocabulary").
DELTA_NET = {
    "q_proj": "colwise",
    "k_proj": "colwise",
    "v_proj": "colwise",
    "b_proj": "colwise",
    "o_norm": "replicated_with_grad_allreduce",
    "o_proj": "rowwise",
}
OLMO_HYBRID_DELTA_NET = {
    **DELTA_NET,
    "a_proj": "colwise",
    "g_proj": "colwise",
    "A_log": "colwise",
    "dt_bias": "colwise",
}
KIMI_DELTA_NET = {
    **DELTA_NET,
    "g_b_proj": "colwise",
    "forget_gate.f_b_proj": "colwise",
    "forget_gate.A_log": "colwise",  # (1, 1, heads, 1): split along the heads (dim 2)
    "forget_gate.dt_bias": "colwise",
}
BAILING_DELTA_NET = {
    **DELTA_NET,
    "g_proj": "colwise",  # a per-channel gate in linear layers, a per-head one in latent attention layers
    "forget_gate": "attention",  # its forward views with num_heads
    "forget_gate.f_proj": "colwise",
    "forget_gate.A_log": "colwise",
    "forget_gate.dt_bias": "colwise",
}


def under(prefix: str, entries: dict[str, str]) -> dict[str, str]:
    return {f"{prefix}.{name}": style for name, style in entries.items()}


def delta_net_conv(attention: str, q: int, k: int, v: int) -> dict[str, str]:
    return {f"layers.*.{attention}.conv1d": f"channelwise({q},{k},{v})"}


def olmo_hybrid_variant(config) -> dict[str, str]:
    key_dim = config.linear_num_key_heads * config.linear_key_head_dim
    value_dim = config.linear_num_value_heads * config.linear_value_head_dim
    view = "attention(num_k_heads, num_v_heads, key_dim, value_dim)"
    return {"layers.*.linear_attn": view, **delta_net_conv("linear_attn", key_dim, key_dim, value_dim)}


def latent_and_delta_variant(config) -> dict[str, str]:
    """Kimi-Linear / Ling: `self_attn` is a delta net in linear layers (its view makes `qkv_dim` local) and latent
    attention in full ones, so where a config mixes them the attention entry is given per layer."""
    width = config.linear_num_heads * config.linear_head_dim
    delta = "attention(num_heads, qkv_dim)"
    views = [delta if kind == "linear_attention" else "attention" for kind in config.layer_types]
    if len(set(views)) == 1:
        attention = {"layers.*.self_attn": views[0]}
    else:
        attention = {f"layers.{index}.self_attn": view for index, view in enumerate(views)}
    return {**attention, **delta_net_conv("self_attn", width, width, width)}


def mamba2_mixer(mixer: str, heads: int, inner: int, groups: int, state: int) -> dict[str, str]:
    """The entries that shard a Mamba2 mixer (the pattern `mixer`) as Megatron does: in_proj's [z; x; B; C; dt] by
    sections (one group's B and C held whole by the ranks sharing it), the conv1d, A_log, D, dt_bias and gated norm with
    their channels, out_proj by rows (docs/own-models.md, "The whole style vocabulary")."""
    b_or_c = f"{groups}x{state}"
    return {
        mixer: f"attention(num_heads, intermediate_size, n_groups({groups}x1), conv_dim({inner},{b_or_c},{b_or_c}))",
        f"{mixer}.A_log": "colwise",
        f"{mixer}.D": "colwise",
        f"{mixer}.dt_bias": "colwise",
        f"{mixer}.in_proj": f"colwise({inner},{inner},{b_or_c},{b_or_c},{heads})",
        f"{mixer}.conv1d": f"channelwise({inner},{b_or_c},{b_or_c})",
        f"{mixer}.norm": "gated_rmsnorm_parallel",
        f"{mixer}.out_proj": "rowwise",
    }


def mamba2_variant(config) -> dict[str, str]:
    inner = int(config.expand * config.hidden_size)
    return mamba2_mixer("layers.*.mixer", config.num_heads, inner, config.n_groups, config.state_size)


def mamba_layers(config) -> dict[str, str]:
    """The Mamba2 mixers of hybrids that keep them at `layers.*.mamba` with `mamba_`-prefixed fields (Bamba,
    GraniteMoeHybrid)."""
    inner = int(config.mamba_expand * config.hidden_size)
    return mamba2_mixer("layers.*.mamba", config.mamba_n_heads, inner, config.mamba_n_groups, config.mamba_d_state)


def falcon_h1_unsupported(model: nn.Module) -> str | None:
    if any(buffer.is_meta for name, buffer in model.named_buffers() if name.endswith("mup_vector")):
        return (
            "built on the meta device, its mixers' mup_vector buffers would stay unset (FalconH1Model's "
            "_init_weights fills them for every layer at once, and tp_train materialises module by module); build "
            "it under tp_train.deferred_init() (as TensorParallelStrategy's init_module does), or on a real device"
        )
    if getattr(model.config, "mamba_rms_norm", False):
        return (
            "its Mamba2 mixers' gated norm (mamba_rms_norm=True, FalconH1RMSNormGated, normalising before the gate "
            "by default) has no parallel form yet; use mamba_rms_norm=False (the default: the gate multiplies "
            "the scan's output)"
        )
    return None


def falcon_h1_layers(config) -> dict[str, str]:
    """Falcon-H1's Mamba2 mixers (beside attention and an MLP in every layer), as `mamba_layers`, their width
    `mamba_d_ssm` when set. in_proj's output is scaled by `mup_vector`, a (1, 1, width) buffer of per-section μP
    multipliers: split with in_proj's sections. Without `mamba_rms_norm` its `norm` is an identity (no entry)."""
    inner = config.mamba_d_ssm or int(config.mamba_expand * config.hidden_size)
    entries = mamba2_mixer("layers.*.mamba", config.mamba_n_heads, inner, config.mamba_n_groups, config.mamba_d_state)
    entries["layers.*.mamba.mup_vector"] = entries["layers.*.mamba.in_proj"]
    del entries["layers.*.mamba.norm"]
    return entries


def nemotron_h_variant(config) -> dict[str, str]:
    """Nemotron-H's Mamba2 mixers (its `linear_attention` layers; `mixer` also names the other layers' attention,
    MLP or MoE, so each is named by its index). Hugging Face's plan shards the experts; the auto-planner completes
    attention and the MLPs."""
    heads, width = config.mamba_num_heads, config.mamba_num_heads * config.mamba_head_dim
    entries = {}
    for index, kind in enumerate(config.layers_block_type):
        if kind == "linear_attention":
            entries |= mamba2_mixer(f"layers.{index}.mixer", heads, width, config.n_groups, config.ssm_state_size)
    return entries


def recurrent_gemma_variant(config) -> dict[str, str]:
    """RecurrentGemma's temporal blocks, each by its kind: a recurrent block's width across heads (`lru_width`, which
    sizes its cached state) and its RG-LRU's head count become local; an attention's head counts as usual."""
    recurrent = "attention(lru_width, rg_lru.num_attention_heads)"
    views = [recurrent if kind == "linear_attention" else "attention" for kind in config.layers_block_type]
    if len(set(views)) == 1:
        return {"layers.*.temporal_block": views[0]}
    return {f"layers.{index}.temporal_block": view for index, view in enumerate(views)}


# RecurrentGemma (Griffin): a temporal block is local attention or a recurrent block split by the RG-LRU's heads
# (`recurrent_gemma_variant` names each block's view; docs/own-models.md).
RECURRENT_GEMMA = {
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
}
# RWKV (v4): the time-mix by channels, the channel-mix's key by columns and value by rows, its receptance whole
# (docs/own-models.md).
RWKV = {
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
# Bamba's, GraniteMoeHybrid's and Nemotron-H's plans shard only the head or the experts, and Falcon-H1 ships none:
# their Mamba2 mixers are added (the zoo's sizes and group counts: docs/own-models.md).
RECORDS = (
    # Mamba2, as Megatron shards it: its mixer's entries are `mamba2_mixer`'s, their sections sized by the config.
    FamilySpec(
        model_type="mamba2",
        preset={"embeddings": "embedding_rowwise"},
        variant=mamba2_variant,
        zoo_fields=dict(num_heads=8, state_size=16),
    ),
    FamilySpec(
        model_type="nemotron_h",
        variant=nemotron_h_variant,
        zoo_fields=dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16),
    ),
    FamilySpec(model_type="bamba", variant=mamba_layers, zoo_fields=dict(mamba_d_state=16)),
    # the zoo's: with Mamba2 layers only its forward cannot build its cache, so the second layer is attention
    FamilySpec(
        model_type="granitemoehybrid",
        variant=mamba_layers,
        zoo_fields=dict(mamba_d_state=16, layer_types=["linear_attention", "full_attention"]),
    ),
    # the zoo's: μP multipliers other than 1 (so its `mup_vector` differs section by section and a wrong split of it
    # shows), scaled keys and MLP
    FamilySpec(
        model_type="falcon_h1",
        variant=falcon_h1_layers,
        unsupported=falcon_h1_unsupported,
        zoo_fields=dict(
            mamba_d_state=16, ssm_multipliers=[0.5, 2.0, 0.25, 4.0, 1.5], key_multiplier=0.5, mlp_multipliers=[2.0, 0.5]
        ),  # fmt: skip
    ),
    FamilySpec(
        model_type="olmo_hybrid",
        additions=under("layers.*.linear_attn", OLMO_HYBRID_DELTA_NET),
        variant=olmo_hybrid_variant,
    ),
    # Kimi-Linear's and Ling's full-attention layers are DeepSeek's latent attention, under the same name.
    FamilySpec(
        model_type="kimi_linear",
        additions={**LATENT_ATTENTION, **under("layers.*.self_attn", KIMI_DELTA_NET)},
        variant=latent_and_delta_variant,
        zoo_fields=dict(linear_num_heads=4, linear_head_dim=8),  # 32 heads of 128 by default
    ),
    FamilySpec(
        model_type="bailing_hybrid",
        additions={**LATENT_ATTENTION, **under("layers.*.self_attn", BAILING_DELTA_NET)},
        variant=latent_and_delta_variant,
    ),
    FamilySpec(model_type="recurrent_gemma", preset=RECURRENT_GEMMA, variant=recurrent_gemma_variant),
    FamilySpec(model_type="rwkv", preset=RWKV),
)
