"""Config vocabulary for the training app: precision as users type it, and the resolvers `conf/` uses."""

from __future__ import annotations

import functools
from pathlib import Path

from omegaconf import OmegaConf

from tp_train.parallel.dims import ParallelDims

# What save_pretrained writes for a tokenizer (a fast tokenizer's tokenizer.json, or its config beside a slow one's
# files); a model directory holding one brings its tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# What users type -> Lightning's precision name. Lightning's own names map to themselves.
LIGHTNING_PRECISIONS = ("32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true")
PRECISIONS = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}
PRECISIONS |= {name: name for name in LIGHTNING_PRECISIONS}


def lightning_precision(value: object) -> str:
    """Lightning's name for a precision written as `32`, `16`, `bf16`, `bf16-true`, ... (raises ValueError)."""
    name = str(value).strip().lower()
    if name not in PRECISIONS:
        raise ValueError(
            f"precision={value} is not a precision; use one of 32, 16, bf16, bf16-true, 16-true, 64 "
            f"(or Lightning's names 32-true, 16-mixed, bf16-mixed)"
        )
    return PRECISIONS[name]


def tokenizer_of(model_path: str | None) -> str | None:
    """The tokenizer a pretrained model directory holds (the directory itself, for AutoTokenizer), or None."""
    if model_path is None:
        return None
    directory = Path(str(model_path)).expanduser()
    return str(model_path) if any((directory / name).is_file() for name in TOKENIZER_FILES) else None


@functools.lru_cache(maxsize=8)
def _special_token_ids(tokenizer_path: str | None) -> dict:
    from tp_train.app.data import special_token_ids

    return special_token_ids(tokenizer_path)


def family_fields(model_type: str | None, config=None) -> dict:
    """The fields `model_type`'s small config sets at the sizes `config` (`model.config`) gives
    (`tp_train.tools.family_configs.small_config`: head widths, expert counts, latent-attention ranks, per-layer
    lists, sub-configs, its record's `zoo_fields`), less the generic sizes and special token ids, which `model.config`
    and the data's tokenizer give; {} for a type that is no Hugging Face family (the build names it)."""
    from transformers import CONFIG_MAPPING

    from tp_train.tools.family_configs import TOKEN_IDS, generic_sizes, record_fields, small_config

    if model_type not in CONFIG_MAPPING:
        return {}
    if config is None:
        return record_fields(model_type)
    given = OmegaConf.to_container(config, resolve=True) if OmegaConf.is_config(config) else dict(config)
    sizes = generic_sizes(model_type, given)
    fields = small_config(model_type, sizes)
    return {key: value for key, value in fields.items() if key not in sizes and key not in TOKEN_IDS}


def family_field(model_type: str | None, field: str, default):
    """`conf/model/hf.yaml`'s generic size `field` for `model_type`: its record's value where the record sets it
    (under the name the family's config maps it to: DBRX's `d_model` for `hidden_size`), else `default`. A value the
    user gives replaces the interpolation, so it wins over both (DeepSeek-V3's kv heads, issue 41)."""
    from transformers import CONFIG_MAPPING

    from tp_train.tools.family_configs import record_fields

    fields = record_fields(model_type) if model_type in CONFIG_MAPPING else {}
    aliases = CONFIG_MAPPING[model_type].attribute_map if model_type in CONFIG_MAPPING else {}
    for name in (field, aliases.get(field)):
        if name in fields:
            return fields[name]
    return default


def positions(model_type: str | None, block_size, token_ids=None, vocab_size=None) -> int:
    """`conf/model/hf.yaml`'s `max_position_embeddings`: the position-table rows `model_type` needs for blocks of
    `block_size` tokens (`tp_train.tools.family_configs.position_rows`); a value the user gives replaces it."""
    from tp_train.tools.family_configs import position_rows

    return position_rows(model_type, int(block_size), dict(token_ids or {}), vocab_size)


def devices(dp, tp, cp, pp, ep) -> int:
    """The devices the config's degrees take (`conf/trainer/default.yaml`), from the one owner of the degrees."""
    return ParallelDims.devices_for(dp=int(dp), tp=int(tp), cp=int(cp), pp=int(pp), ep=int(ep))


def register_resolvers() -> None:
    """`${devices:dp,tp,cp,pp,ep}` (the ranks those degrees take: `ParallelDims.devices_for`), `${precision:16}`,
    `${tokenizer_of:${model.path}}` (a pretrained model's own tokenizer, so its token ids mean what it learned) and
    `${special_token_ids:${data.tokenizer_path}}` (the data's tokenizer's pad, bos and eos ids, which a model built
    from its family's config takes) and `${family_fields:${model.type},${model.config}}` (the family's small config
    at those sizes), `${family_field:${model.type},FIELD,DEFAULT}` and
    `${positions:${model.type},BLOCK,TOKEN_IDS,VOCAB}` (the position-table rows a block takes) for conf/."""
    resolvers = {"devices": devices, "precision": lightning_precision, "tokenizer_of": tokenizer_of,
                 "special_token_ids": lambda path: dict(_special_token_ids(path)),
                 "family_fields": family_fields, "family_field": family_field, "positions": positions}  # fmt: skip
    for name, resolver in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, resolver)
