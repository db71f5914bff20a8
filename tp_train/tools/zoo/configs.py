"""The zoo's tiny configs: the generic sizes every family gets, the fields each family's own layout needs (its
record's `zoo_fields`, `tp_train.plan.families`), and building a family's model from them (`tp_train.tools.zoo_tasks`
for the task's class)."""

from __future__ import annotations

import copy

from tp_train.plan.families import family
from tp_train.tools.zoo_tasks import build

TOLERANCE = 1e-5
VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
# Widths beyond the generic sizes, set wherever a (sub-)config has them as an int (what each group is for:
# docs/zoo.md, "Tiny configs").
WIDTHS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
              expert_intermediate_size=32, expert_ffn_hidden_size=32, kv_lora_rank=16, q_lora_rank=16,
              qk_rope_head_dim=4, qk_nope_head_dim=4, qk_head_dim=8, v_head_dim=8, out_hidden_size=32,
              hidden_size_global=32, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32,
              adapter_in_dim=32, adapter_out_dim=32, adapter_input_size=32, linear_key_head_dim=8,
              linear_value_head_dim=8, index_head_dim=8, index_topk=8, encoder_hash_byte_group_vocab=64,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
              decoder_ffn_dim=64, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
              num_decoder_attention_heads=4, mamba_n_heads=8, mamba_d_head=8, mamba_d_ssm=64,
              laurel_rank=8)  # fmt: skip


def tiny_config(model_type: str) -> dict:
    """`SIZES` (but a size the family refuses to set), plus the fields of this family's config that must agree with
    them: a head width (8) where the config has one, a rotary width that fits a head, special token ids inside the
    tiny vocabulary, the `WIDTHS` the config has, expert counts its default leaves None, per-layer lists it would keep
    at the default layer count (shortened, one layer of each kind first), fewer kv-sharing layers than the tiny
    model has, the family's `zoo_fields`, and each sub-config (a multimodal model's `text_config`, `vision_config`,
    `audio_config`, ...) made tiny the same way (with the `zoo_fields` of its own model type), so no part of the
    model keeps its full size."""
    from transformers import CONFIG_MAPPING

    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports it
        return dict(SIZES)
    sizes = {field: value for field, value in SIZES.items() if _accepts(defaults, field, value)}
    return {**sizes, **_tiny_fields(defaults), **family_fields(model_type)}


def family_fields(model_type: str) -> dict:
    """The fields `model_type`'s record gives its tiny config (`FamilySpec.zoo_fields`); {} without any."""
    spec = family(model_type)
    return dict(spec.zoo_fields) if spec and spec.zoo_fields else {}


def _tiny_fields(defaults) -> dict:
    """The fields of one config (`defaults`, a default instance) that `tiny_config` sets beyond `SIZES`; a
    sub-config is given as a dict of only the fields it has, `SIZES` too."""
    from transformers import PretrainedConfig

    config = {}
    head = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    head_widths = {"head_dim": head, "d_head": head, "attention_head_size": head, "rotary_dim": head // 2}
    for field, value in head_widths.items():
        if isinstance(_value(defaults, field), int) and _settable(defaults, field):
            config[field] = value
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(_value(defaults, field), int) and _value(defaults, field) >= VOCAB:
            config[field] = VOCAB - 1
    for field, value in WIDTHS.items():  # fields of its own only: xLSTM's `qk_head_dim` is a read-only property
        if isinstance(vars(defaults).get(field), int):
            config[field] = value
    for field, value in (("num_experts_per_tok", 2), ("n_routed_experts", 4), ("n_shared_experts", 1)):  # dots1
        if field in vars(defaults) and vars(defaults)[field] is None:
            config[field] = value
    config.update(_per_layer_lists(defaults))
    shared = vars(defaults).get("num_kv_shared_layers")  # Gemma 3n: the last layers reuse earlier layers' keys/values
    if isinstance(shared, int) and shared >= SIZES["num_hidden_layers"]:
        config["num_kv_shared_layers"] = SIZES["num_hidden_layers"] - 1  # one layer must still produce them
    if "qk_rope_head_dim" in config:  # latent attention: head_dim is the rotary part of a query/key head
        config["head_dim"] = config["qk_rope_head_dim"]
    for field in getattr(type(defaults), "sub_configs", {}):
        sub = getattr(defaults, field, None)
        if isinstance(sub, PretrainedConfig) and sub.model_type:  # not DBRX's attn_config: part of its parent
            sizes = {key: value for key, value in SIZES.items() if isinstance(_value(sub, key), int)}
            config[field] = {
                "model_type": sub.model_type, **sizes, **_tiny_fields(sub), **family_fields(sub.model_type)
            }  # fmt: skip
            if "num_hidden_layers" in sizes and isinstance(_value(sub, "mlp_layer_types"), list):
                # per-layer MLP kinds (dots3's vision tower) are not re-derived from the layer count: keep the first
                config[field]["mlp_layer_types"] = sub.mlp_layer_types[: SIZES["num_hidden_layers"]]
    return config


def _per_layer_lists(defaults) -> dict:
    """Per-layer lists (`layer_types`, Zamba's `layers_block_type`) that the config keeps at its default layer count
    when given the tiny one (a fixed default, or one derived with a fixed prefix), shortened to the tiny count: the
    first layer, then the first of each other kind, so a hybrid keeps an attention and a mixer layer."""
    layers, tiny = _value(defaults, "num_hidden_layers"), SIZES["num_hidden_layers"]
    if not isinstance(layers, int) or layers <= tiny:
        return {}
    try:
        shrunk = vars(type(defaults)(num_hidden_layers=tiny))
    except Exception:  # noqa: BLE001 - its own validation rejects the lists the tiny count leaves
        shrunk = {}
    lists = {}
    for field, value in vars(defaults).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and not field.startswith("_"):
            if len(shrunk.get(field) or ()) != tiny:
                kept = [0]
                for index, kind in enumerate(value):  # == rather than hashing: a kind may be a list
                    if all(kind != value[other] for other in kept):
                        kept.append(index)
                kept = sorted((kept + [i for i in range(layers) if i not in kept])[:tiny])
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


def build_family(task: str, family: str, fields: dict | None = None):
    """The family's tiny model for the task (`tp_train.tools.zoo_tasks.build`), from `tiny_config` (a tower's: its
    dual encoder's) with `fields` set."""
    model_type = family.split(".")[0]
    return build(task, family, _with_fields(tiny_config(model_type), _own_fields(model_type, fields or {})))


def _own_fields(model_type: str, fields: dict) -> dict:
    """`fields` less those the family's config maps onto the field its query heads are read from (Whisper's
    `num_key_value_heads` is its `encoder_attention_heads`): setting kv heads there would shrink the query heads of
    a model with as many kv heads as query heads, not group them."""
    from transformers import CONFIG_MAPPING

    aliases = CONFIG_MAPPING[model_type].attribute_map if model_type in CONFIG_MAPPING else {}
    heads = aliases.get("num_attention_heads")
    return {field: value for field, value in fields.items() if heads is None or aliases.get(field) != heads}


def _with_fields(config: dict, fields: dict) -> dict:
    """`config` with `fields` set at its top and in each sub-config (a dict) that has them (a multimodal model's text
    config keeps its own kv heads)."""
    config = {**config, **fields}
    for key, value in config.items():
        if isinstance(value, dict) and key not in fields:
            config[key] = {**value, **{field: fields[field] for field in fields if field in value}}
    return config
