"""Hugging Face causal LMs as config choices: any family built from its config (random init, nothing downloaded),
or a model saved in a local directory (`config.json` + safetensors weights). Nothing here knows about parallelism.

Configs name sizes in Hugging Face's generic vocabulary (`hidden_size`, `num_attention_heads`, ...); each family's
`attribute_map` translates them (GPT-2's `hidden_size` is `n_embd`), so one set of defaults fits most families.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn

# Generic size fields: each is set where the family has it (directly or through its `attribute_map`, or under a
# name in SIZE_ALIASES) and skipped where it has none (GPT-2 has no kv heads). Any other key must be a field.
SIZE_FIELDS = (
    "vocab_size",
    "max_position_embeddings",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)
SIZE_ALIASES = {"intermediate_size": ("n_inner", "ffn_dim")}  # GPT-2 / GPT-J, OPT
# GPT-2's names for generic sizes, which `models.GPTConfig` uses too: a preset sizing both kinds of model
# (`experiment=smoke`) sets these, and a family without them takes them as the generic field.
GPT_NAMES = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_embd": "hidden_size"}


def hugging_face_causal_lm(
    type: str | None = "llama",
    path: str | None = None,
    config: dict | None = None,
    token_ids: dict | None = None,
    family_fields: dict | None = None,
) -> nn.Module:
    """A Hugging Face `AutoModelForCausalLM` built from a family's config, or from a local directory.

    Args:
        type: the family's `model_type` (`llama`, `gpt2`, `gpt_neox`, `mistral`, `qwen2`, `opt`, ...); the model
            is built from that family's default config updated with `config`, randomly initialised.
        path: a local directory written by `save_pretrained` (ignores `type` and `config`). Built under the meta
            device (`trainer.init_module(empty_init=True)`), the model is left empty and records the directory as
            `pretrained_weights`: tp_train fills each rank's shards from it after sharding. Built anywhere else, it
            is loaded with `from_pretrained`. Either way its parameters take the default dtype (set by Lightning's
            precision), not the dtype the files hold.
        config: fields of the family's config; the generic size fields (`SIZE_FIELDS`) are skipped where the family
            has no such field, any other key must be one of the family's fields.
        token_ids: the special token ids of the tokenizer the model is trained with (`pad_token_id`,
            `bos_token_id`, `eos_token_id`; None where it has no such token), set in place of the family's defaults
            where its config has the field (Phi-3's pad id 32000 lies outside a 512-token vocabulary, and Gemma's
            pad id 0 would freeze the embedding row of the data's EOS); a key also in `config` keeps config's value.
            Ignored with `path`.
        family_fields: fields the family needs at `config`'s sizes (the app passes the family's small config,
            `tp_train.tools.family_configs`, which the zoo's tiny configs come from: expert counts, latent-attention
            ranks, head widths, per-layer lists, its record's `zoo_fields`); a key of `config` naming the same field
            wins over it (conf/model/hf.yaml's generic sizes take the record's value unless the user sets them).
            Ignored with `path`.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if path is not None:
        directory = Path(path).expanduser()
        if not (directory / "config.json").is_file():
            raise ValueError(f"path={path}: no config.json there; use a directory written by save_pretrained")
        # In the dtype the caller builds in (Lightning's precision sets it), not the one the weights were saved in.
        dtype = torch.get_default_dtype()
        if not torch.empty(0).is_meta:  # safetensors only: a pickled .bin could run code when read
            return AutoModelForCausalLM.from_pretrained(
                directory, local_files_only=True, dtype=dtype, use_safetensors=True
            )
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.pretrained_weights = str(directory)
        return model
    fields = _layered_fields(type, config or {}, token_ids or {}, family_fields or {})
    return hugging_face_model(type, fields, AutoModelForCausalLM)


def _layered_fields(model_type: str | None, config: dict, token_ids: dict, family_fields: dict) -> dict:
    """`config` over `family_fields` over the entries of `token_ids` the family has, each size in the family's own
    name (its `attribute_map`'s: DBRX's `d_model` for `hidden_size`), as its saved configs name it: a config that
    derives fields from a size in `__post_init__` (DBRX's `ffn_config.hidden_size`) sees it there, where a generic
    name is set only after. A family field is dropped where a key of `config` names the same field."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return dict(config)  # `_config_fields` names the family that does not exist
    defaults = CONFIG_MAPPING[model_type]()
    aliases = type(defaults).attribute_map
    config = {aliases.get(key, key): value for key, value in config.items()}  # the later of two names of one field
    family = {key: value for key, value in family_fields.items() if aliases.get(key, key) not in config}
    vocab = config.get(aliases.get("vocab_size", "vocab_size"), _field_value(defaults, "vocab_size"))
    return {**special_token_fields(model_type, token_ids, vocab), **family, **config}


def special_token_fields(model_type: str, token_ids: dict, vocab) -> dict:
    """The special token ids a `model_type` config built for the data's tokenizer takes (`token_ids`: its pad, bos
    and eos ids, None where it lacks one), for the fields the family's config has."""
    from transformers import CONFIG_MAPPING

    defaults = CONFIG_MAPPING[model_type]()
    specials = {field: value for field, value in token_ids.items() if _has_field(defaults, field)}
    return {field: _lacking_id(defaults, field, token_ids, vocab) if value is None else value
            for field, value in specials.items()}  # fmt: skip


def _lacking_id(defaults, field: str, token_ids: dict, vocab) -> int | None:
    """The id a config takes for a special token the data's tokenizer lacks: None (dropped), but for the pad id
    the family's default where it lies inside the vocabulary and is none of the tokenizer's ids (RoBERTa's
    embeddings count positions from it: camembert, data2vec-text, xlm-roberta; Gemma's 0, the data's EOS, is
    dropped), and the tokenizer's EOS where the config refuses None (CWM's int `bos_token_id`)."""
    default = _field_value(defaults, field)
    taken = set(token_ids.values())
    if field == "pad_token_id" and isinstance(default, int) and 0 <= default < vocab and default not in taken:
        return default
    try:
        type(defaults)(**{field: None})
    except Exception:  # noqa: BLE001 - huggingface_hub's StrictDataclassFieldValidationError, a TypeError's cause
        return token_ids.get("eos_token_id")
    return None


def hugging_face_model(type: str, config: dict | None = None, auto_class=None) -> nn.Module:
    """A Hugging Face model of family `type` for one task, built from its config with random init: `auto_class`
    is the task's auto class (`AutoModelForMaskedLM`, `AutoModelForSeq2SeqLM`, ...; default `AutoModel`, the bare
    model, as a CLIP text or vision tower is) or a model class (`DeiTForImageClassification`), `config` as
    `hugging_face_causal_lm`'s."""
    from transformers import AutoConfig, AutoModel

    fields = _config_fields(type, dict(config or {}))
    auto_class = auto_class or AutoModel
    build = getattr(auto_class, "from_config", None) or auto_class._from_config
    # torch's grouped_mm, transformers' default for expert layers, takes no float64: the loop over experts does
    options = {"experts_implementation": "eager"} if torch.get_default_dtype() == torch.float64 else {}
    try:
        return build(AutoConfig.for_model(type, **fields), **options)
    except ValueError as error:  # the family's own validation (GPT-Neo's attention_types), or no head for the task
        raise ValueError(f"type={type}: {' '.join(str(error).split())}") from None


def _has_field(config, field: str) -> bool:
    """Whether the config has the field; one it keeps per layer (Gemma 4's `head_dim`) raises when read as one
    value, yet it is a field to set."""
    try:
        return hasattr(config, field)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return field in vars(config)


def _field_value(config, field: str):
    """`config.field` (0 where it has none); a per-layer field read from the config's own attributes."""
    try:
        return getattr(config, field, 0)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(field, 0)


def _config_fields(model_type: str | None, config: dict) -> dict:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"type={model_type} is not a Hugging Face model_type; use one of llama, gpt2, gpt_neox, mistral, qwen2, "
            f"opt, gptj, ... (or path=DIR for a saved model)"
        )
    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()  # resolves the family's attribute_map: hasattr(GPT2Config(), "hidden_size")
    aliases = type(defaults).attribute_map
    fields = {}
    for key, value in config.items():
        name = key if _has_field(defaults, key) else None
        if name is None and key in GPT_NAMES and _has_field(defaults, GPT_NAMES[key]):
            name = GPT_NAMES[key]
        if name is None:
            name = next((alias for alias in SIZE_ALIASES.get(key, ()) if _has_field(defaults, alias)), None)
        if name is not None:
            # A size given twice under two names of one field (hidden_size, n_embd) is set once: the later. The key
            # stays the name it was given in: a config that derives fields from its sizes in __init__ (Switch
            # Transformers' encoder_sparse_step from num_layers) saw the generic names after __init__ before.
            fields = {k: v for k, v in fields.items() if aliases.get(k, k) != aliases.get(name, name)}
            fields[name] = value
        elif key not in SIZE_FIELDS:
            raise ValueError(
                f"config.{key}={value}: {config_class.__name__} has no field '{key}'; "
                f"its fields include {', '.join(sorted(defaults.to_diff_dict())[:8])}, ..."
            )
    # Some families (HunYuan) leave head_dim None by default and then fail to build: derive it from the sizes.
    if _field_value(defaults, "head_dim") is None and "head_dim" not in fields:
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if hidden and heads:
            fields["head_dim"] = hidden // heads
    return fields
