"""Records of Zamba and Zamba2: the shared transformer block splits as Llama's, and its down_proj reduce-scatters its
output (`rowwise_scatter_output`) into its hybrid layer's `linear`, split by rows (docs/own-models.md)."""

from __future__ import annotations

from tp_train.plan.deciding.families.recurrent import mamba2_mixer, under
from tp_train.plan.deciding.families.spec import FamilySpec

# Zamba's Mamba mixer: `n_mamba_heads` independent heads with their own (heads, ...) parameters, split by those heads
# (in_proj's interleaved [x; z] channels by a plain column split; docs/own-models.md).
ZAMBA_MAMBA = {
    "in_proj": "colwise",
    "conv1d": "channelwise",
    "x_proj_weight": "channelwise",
    "dt_proj_weight": "channelwise",
    "dt_proj_bias": "channelwise",
    "A_log": "channelwise",
    "D": "channelwise",
    "out_proj": "rowwise",
}
SHARED_ATTENTION = {
    "self_attn": "attention",
    "self_attn.q_proj": "colwise",
    "self_attn.k_proj": "colwise",
    "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise",
    "feed_forward.down_proj": "rowwise_scatter_output",  # its output feeds only the hybrid layer's `linear`
}
# Zamba2's adapters: the down Linear whole, the up one split as the projection it adds to (docs/own-models.md).
ATTENTION_ADAPTERS = {
    f"self_attn.linear_{name}_adapter_list.*.{index}": style
    for name in "qkv"
    for index, style in ((0, "replicate"), (1, "colwise"))
}
MLP_ADAPTERS = {
    "feed_forward.gate_up_proj_adapter_list.*.0": "replicate",
    "feed_forward.gate_up_proj_adapter_list.*.1": "packed_colwise",
}


def mixer_patterns(config) -> list[str]:
    """Where the Mamba mixers are: `layers.*.mamba` in a Mamba layer, `layers.*.mamba_decoder.mamba` in a hybrid one
    (the Mamba layer behind the shared block), for the kinds of layer the config builds."""
    kinds = set(config.layers_block_type)
    mamba, hybrid = kinds - {"hybrid"}, kinds & {"hybrid"}
    return [
        pattern for pattern, built in (("layers.*.mamba", mamba), ("layers.*.mamba_decoder.mamba", hybrid)) if built
    ]


def _hybrid(config, block: str, entries: dict[str, str]) -> dict[str, str]:
    """The shared block's entries (under `block`) and the hybrid layers' `linear`, when the config builds hybrids."""
    if "hybrid" not in config.layers_block_type:
        return {}
    return {**under(f"layers.*.{block}", entries), "layers.*.linear": "rowwise"}


def zamba_layers(config) -> dict[str, str]:
    entries = {}
    for mixer in mixer_patterns(config):
        entries |= {mixer: "attention(n_mamba_heads, intermediate_size)", **under(mixer, ZAMBA_MAMBA)}
    mlp = {"feed_forward.gate_proj": "colwise", "feed_forward.up_proj": "colwise"}
    return entries | _hybrid(config, "shared_transf", {**SHARED_ATTENTION, **mlp})


def zamba2_layers(config) -> dict[str, str]:
    """Zamba2's mixers are Mamba2's (`mamba2_mixer`: in_proj's [z; x; B; C; dt], the gated norm normalising
    `mamba_ngroups` groups); its shared block's MLP has a fused [gate; up] projection, and both take adapters."""
    inner = int(config.mamba_expand * config.hidden_size)
    entries = {}
    for mixer in mixer_patterns(config):
        entries |= mamba2_mixer(mixer, config.n_mamba_heads, inner, config.mamba_ngroups, config.mamba_d_state)
    block = {**SHARED_ATTENTION, "feed_forward.gate_up_proj": "packed_colwise", **MLP_ADAPTERS}
    if config.use_shared_attention_adapter:
        block |= ATTENTION_ADAPTERS
    return entries | _hybrid(config, "shared_transformer", block)


RECORDS = (
    # the zoo's: shared attention tied across two hybrid layers; 4 Mamba heads of 16 (2 by default), so tp 4 divides
    FamilySpec(
        model_type="zamba",
        preset={"embed_tokens": "embedding_rowwise"},
        variant=zamba_layers,
        zoo_fields=dict(layers_block_type=["hybrid", "hybrid"], n_mamba_heads=4),
    ),
    # the zoo's: a Mamba2 layer, then a hybrid one, an 8-wide state and adapters of rank 8 (128 by default)
    FamilySpec(
        model_type="zamba2",
        preset={"embed_tokens": "embedding_rowwise"},
        variant=zamba2_layers,
        zoo_fields=dict(mamba_d_state=8, adapter_rank=8),
    ),
)
