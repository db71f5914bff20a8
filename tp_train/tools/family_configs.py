"""A Hugging Face family's small config at given generic sizes: the fields of its config that must agree with them
(head widths, expert counts and widths, latent-attention ranks, per-layer lists, sub-configs) and its record's
`zoo_fields` (`tp_train.plan.deciding.families`). One derivation serves the zoo's tiny configs
(`tp_train.tools.zoo.configs`, at its `SIZES`) and `python train.py model=hf model.type=X` (at `conf/model/hf.yaml`'s
sizes, through the app's `family_fields` resolver)."""

from __future__ import annotations

import copy

from models.hf import GPT_NAMES, SIZE_ALIASES, SIZE_FIELDS, special_token_fields
from tp_train.plan.deciding.families import family

TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
EXPERT_COUNTS = dict(num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1)  # where the default is None


def widths(sizes: dict) -> dict:
    """The widths beyond the generic sizes, set wherever a (sub-)config has them as an int (what each group is for:
    docs/zoo.md, "Tiny configs"), from `sizes`' hidden width, MLP width, layers, heads and vocabulary."""
    hidden, mlp, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    heads, vocab = sizes["num_attention_heads"], sizes["vocab_size"]
    head = hidden // heads
    expert_widths = ("moe_intermediate_size", "shared_expert_intermediate_size", "shared_experts_intermediate_size",
                     "expert_intermediate_size", "expert_ffn_hidden_size")  # fmt: skip
    handed_over = ("out_hidden_size", "hidden_size_global", "projector_input_dim", "projector_output_dim",
                   "vision_output_dim", "adapter_in_dim", "adapter_out_dim", "adapter_input_size")  # fmt: skip
    head_widths = ("qk_head_dim", "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "index_head_dim")
    return {
        **dict.fromkeys(expert_widths, hidden),
        **dict(
            kv_lora_rank=hidden // 2, q_lora_rank=hidden // 2, qk_rope_head_dim=head // 2, qk_nope_head_dim=head // 2
        ),  # fmt: skip
        **dict.fromkeys(head_widths, head),
        **dict.fromkeys(handed_over, hidden),
        **dict(
            index_topk=8,
            encoder_hash_byte_group_vocab=64,
            vocab_size_per_layer_input=vocab,
            hidden_size_per_layer_input=8,
            laurel_rank=hidden // 4,
        ),  # fmt: skip
        **dict.fromkeys(
            (
                "encoder_attention_heads",
                "decoder_attention_heads",
                "num_encoder_attention_heads",
                "num_decoder_attention_heads",
            ),
            heads,
        ),  # fmt: skip
        **dict.fromkeys(("encoder_layers", "decoder_layers", "num_encoder_layers", "num_decoder_layers"), layers),
        **dict.fromkeys(("encoder_ffn_dim", "decoder_ffn_dim"), mlp),
        # a Mamba2 mixer: heads x head width = expand (2) x hidden
        **dict(mamba_n_heads=2 * hidden // head, mamba_d_head=head, mamba_d_ssm=2 * hidden),
    }


def small_config(model_type: str, sizes: dict) -> dict:
    """`sizes` (generic names: `SIZE_FIELDS`; but a size the family refuses to set), plus the fields of this
    family's config that must agree with them: a head width (hidden / heads) where the config has one, a rotary width
    that fits a head, special token ids inside the vocabulary, the `widths` the config has, expert counts its default
    leaves None, per-layer lists it would keep at the default layer count (shortened, one layer of each kind first),
    fewer kv-sharing layers than the model has, the family's `zoo_fields`, and each sub-config (a multimodal model's
    `text_config`, `vision_config`, `audio_config`, ...) made small the same way (with the `zoo_fields` of its own
    model type), so no part of the model keeps its full size."""
    from transformers import CONFIG_MAPPING

    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports it
        return dict(sizes)
    accepted = {field: value for field, value in sizes.items() if _accepts(defaults, field, value)}
    return {**accepted, **_small_fields(defaults, sizes), **record_fields(model_type)}


def position_rows(model_type: str | None, block_size: int, token_ids: dict, vocab_size) -> int:
    """The position-table rows `model_type` needs for blocks of `block_size` tokens: the block, and for a family
    whose positions count on from the pad id (its record's `positions_after_padding`: RoBERTa's) that id + 1 more,
    the id the model is built with for the data's `token_ids` (the tokenizer's, or the family's own)."""
    spec = family(model_type)
    if spec is None or not spec.positions_after_padding:
        return block_size
    pad = special_token_fields(model_type, token_ids, vocab_size).get("pad_token_id")
    return block_size + (pad + 1 if pad is not None else 0)


def record_fields(model_type: str) -> dict:
    """The fields `model_type`'s record gives its small config (`FamilySpec.zoo_fields`); {} without any."""
    spec = family(model_type)
    return dict(spec.zoo_fields) if spec and spec.zoo_fields else {}


def generic_sizes(model_type: str, config: dict) -> dict:
    """The generic sizes (`SIZE_FIELDS`) `config` gives, read under whichever name it gives each (the generic one,
    GPT's `n_embd`, or the family's own `d_model`; the later of two names of one size, as `models.hf` sets them);
    a size it does not give is the family's default."""
    from transformers import CONFIG_MAPPING

    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports a family whose defaults fail its own validation
        defaults = None
    own = {name: generic for generic, name in getattr(type(defaults), "attribute_map", {}).items()}
    own |= {alias: generic for generic, aliases in SIZE_ALIASES.items() for alias in aliases}
    sizes = {field: _value(defaults, field) for field in SIZE_FIELDS}
    for key, value in config.items():
        generic = key if key in SIZE_FIELDS else GPT_NAMES.get(key) or own.get(key)
        if generic in SIZE_FIELDS:
            sizes[generic] = value
    return sizes


def departures(model_type: str, config: dict) -> dict[str, tuple]:
    """{field: (config's value, the small config's)} for each field `config` sets otherwise than the family's small
    config at `config`'s sizes (`small_config`; its record's sizes too: DeepSeek-V3's kv heads), a size compared
    under the family's own name (DBRX's `d_model` for `hidden_size`)."""
    from transformers import CONFIG_MAPPING

    aliases = CONFIG_MAPPING[model_type].attribute_map if model_type in CONFIG_MAPPING else {}
    small = {
        aliases.get(key, key): value
        for key, value in small_config(model_type, generic_sizes(model_type, config)).items()
    }
    given = {aliases.get(key, key): value for key, value in config.items() if key not in TOKEN_IDS}
    return {field: (value, small[field]) for field, value in given.items() if field in small and small[field] != value}


def unset_fields(model_type: str, fields: dict) -> list[str]:
    """The fields of `model_type`'s config that are None with `fields` set though their type takes an int (Dots1's
    expert counts by default): what a model that cannot be built may need; special token ids are left out."""
    import dataclasses

    from transformers import CONFIG_MAPPING

    try:
        config = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - no config: nothing to name
        return []
    types = (
        {field.name: str(field.type) for field in dataclasses.fields(config)}
        if dataclasses.is_dataclass(config)
        else {}
    )
    values = {**vars(config), **fields}
    return [name for name, value in values.items()
            if value is None and "int" in types.get(name, "") and name not in TOKEN_IDS]  # fmt: skip


def _small_fields(defaults, sizes: dict) -> dict:
    """The fields of one config (`defaults`, a default instance) that `small_config` sets beyond `sizes`; a
    sub-config is given as a dict of only the fields it has, `sizes` too."""
    from transformers import PretrainedConfig

    config = {}
    head = sizes["hidden_size"] // sizes["num_attention_heads"]
    head_widths = {"head_dim": head, "d_head": head, "attention_head_size": head, "rotary_dim": head // 2}
    for field, value in head_widths.items():
        if isinstance(_value(defaults, field), int) and _settable(defaults, field):
            config[field] = value
    vocab = sizes["vocab_size"]
    for field in TOKEN_IDS:
        if isinstance(_value(defaults, field), int) and _value(defaults, field) >= vocab:
            config[field] = vocab - 1
    for field, value in widths(sizes).items():  # fields of its own only: xLSTM's `qk_head_dim` is a read-only property
        if isinstance(vars(defaults).get(field), int):
            config[field] = value
    for field, value in EXPERT_COUNTS.items():  # Dots1
        if field in vars(defaults) and vars(defaults)[field] is None:
            config[field] = value
    config.update(_per_layer_lists(defaults, sizes["num_hidden_layers"]))
    shared, layers = vars(defaults).get("num_kv_shared_layers"), sizes["num_hidden_layers"]
    if isinstance(shared, int) and shared >= layers:  # Gemma 3n: the last layers reuse earlier layers' keys/values
        config["num_kv_shared_layers"] = layers - 1  # one layer must still produce them
    if "qk_rope_head_dim" in config:  # latent attention: head_dim is the rotary part of a query/key head
        config["head_dim"] = config["qk_rope_head_dim"]
    for field in getattr(type(defaults), "sub_configs", {}):
        sub = getattr(defaults, field, None)
        if isinstance(sub, PretrainedConfig) and sub.model_type:  # not DBRX's attn_config: part of its parent
            sub_sizes = {key: value for key, value in sizes.items()
                         if isinstance(value, int) and isinstance(_value(sub, key), int)}  # fmt: skip
            config[field] = {"model_type": sub.model_type, **sub_sizes, **_small_fields(sub, sizes),
                             **record_fields(sub.model_type)}  # fmt: skip
            if "num_hidden_layers" in sub_sizes and isinstance(_value(sub, "mlp_layer_types"), list):
                # per-layer MLP kinds (dots3's vision tower) are not re-derived from the layer count: keep the first
                config[field]["mlp_layer_types"] = sub.mlp_layer_types[:layers]
    return config


def _per_layer_lists(defaults, layers: int) -> dict:
    """Per-layer lists (`layer_types`, Zamba's `layers_block_type`) that the config keeps at its default layer count
    when given `layers` (a fixed default, or one derived with a fixed prefix), shortened to `layers`: the first
    layer, then the first of each other kind, so a hybrid keeps an attention and a mixer layer."""
    default_layers = _value(defaults, "num_hidden_layers")
    if not isinstance(default_layers, int) or default_layers <= layers:
        return {}
    try:
        shrunk = vars(type(defaults)(num_hidden_layers=layers))
    except Exception:  # noqa: BLE001 - its own validation rejects the lists the small count leaves
        shrunk = {}
    lists = {}
    for field, value in vars(defaults).items():
        if isinstance(value, (list, tuple)) and len(value) == default_layers and not field.startswith("_"):
            if len(shrunk.get(field) or ()) != layers:
                kept = [0]
                for index, kind in enumerate(value):  # == rather than hashing: a kind may be a list
                    if all(kind != value[other] for other in kept):
                        kept.append(index)
                kept = sorted((kept + [i for i in range(default_layers) if i not in kept])[:layers])
                lists[field] = type(value)(value[i] for i in kept)
    return lists


def _accepts(config, field: str, value) -> bool:
    """False where the family refuses to set a generic size (ProphetNet's `num_hidden_layers`, XLNet's
    `max_position_embeddings`: properties whose setters raise; PVT's per-stage `num_attention_heads`, a list)."""
    try:
        setattr(copy.deepcopy(config), field, value)
    except Exception:  # noqa: BLE001 - a setter that raises, or a strict field of another type (a list)
        return False
    return True


def _settable(config, field: str) -> bool:
    """False for a read-only property (Falcon's `head_dim`, derived from the sizes)."""
    attribute = getattr(type(config), field, None)
    return not isinstance(attribute, property) or attribute.fset is not None


def _value(config, field: str):
    """`config.field`, or None where it has none; a field some configs keep per layer (Gemma 4's `head_dim`) is read
    from the config's own attributes, since reading it as one value raises."""
    try:
        return getattr(config, field, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(field)
