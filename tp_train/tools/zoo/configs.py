"""The zoo's tiny configs: each family's small config (`tp_train.tools.family_configs`, the one `train.py model=hf`
builds too) at the zoo's generic sizes, and building a family's model from it (`tp_train.tools.zoo_tasks` for the
task's class)."""

from __future__ import annotations

from tp_train.tools.family_configs import record_fields, small_config
from tp_train.tools.zoo_tasks import build

TOLERANCE = 1e-5
VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip


def tiny_config(model_type: str) -> dict:
    """The family's small config at `SIZES` (`tp_train.tools.family_configs.small_config`): hidden 32, 2 layers, 4
    heads and 4 kv heads, an MLP of 64, a vocabulary of 128, and the fields of its config that must agree with them."""
    return small_config(model_type, SIZES)


def family_fields(model_type: str) -> dict:
    """The fields `model_type`'s record gives its tiny config (`FamilySpec.zoo_fields`); {} without any."""
    return record_fields(model_type)


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
