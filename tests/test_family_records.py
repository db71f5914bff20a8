"""Family records (`tp_train.plan.deciding.families`): a family added through one `FamilySpec` reaches the presets, the
planner and the zoo; a record missing what it needs is refused in one line; every record builds valid entries for its
own tiny config."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch.nn as nn
from transformers import CONFIG_MAPPING, PretrainedConfig

from tp_train.plan.deciding.families import FamilySpec, family, register, registered, unregister
from tp_train.plan.deciding.resolve import preset_plan, resolve_plan
from tp_train.plan.styles import check_style
from tp_train.tools.zoo import tiny_config

MADE_UP = "tp_train_made_up"
RECORD = FamilySpec(
    model_type=MADE_UP,
    preset={"embed": "embedding_rowwise", "layers.*.up": "colwise", "layers.*.down": "rowwise"},
    zoo_fields=dict(made_up_width=24),
)


class MadeUpConfig(PretrainedConfig):
    model_type = MADE_UP

    def __init__(self, vocab_size=32, hidden_size=16, made_up_width=64, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.hidden_size, self.made_up_width = vocab_size, hidden_size, made_up_width


class MadeUpBlock(nn.Module):
    def __init__(self, config: MadeUpConfig):
        super().__init__()
        self.up = nn.Linear(config.hidden_size, config.made_up_width)
        self.down = nn.Linear(config.made_up_width, config.hidden_size)

    def forward(self, x):
        return x + self.down(self.up(x).relu())


class MadeUpLM(nn.Module):
    base_model_prefix = "model"

    def __init__(self, config: MadeUpConfig):
        super().__init__()
        self.config = config
        self.model = nn.Module()
        self.model.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model.layers = nn.ModuleList([MadeUpBlock(config) for _ in range(2)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        x = self.model.embed(input_ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


@pytest.fixture
def made_up_family():
    """The made-up family's record and config registered for one test, removed after."""
    register(RECORD)
    CONFIG_MAPPING.register(MADE_UP, MadeUpConfig)
    try:
        yield RECORD
    finally:
        unregister(MADE_UP)
        CONFIG_MAPPING._extra_content.pop(MADE_UP, None)


def test_a_family_added_through_one_record_reaches_the_presets_the_planner_and_the_zoo(made_up_family):
    model = MadeUpLM(MadeUpConfig())
    expected = {f"model.{key}": style for key, style in RECORD.preset.items()} | {"lm_head": "colwise_gather_output"}
    assert preset_plan(model) == expected
    plan, source = resolve_plan(model, tensor_parallel_size=2)
    assert (dict(plan), source) == (expected, f"the built-in preset for model_type '{MADE_UP}'")
    assert tiny_config(MADE_UP)["made_up_width"] == 24  # the zoo's tiny config, from the record's zoo_fields
    register(replace(RECORD, unshardable="its made-up blocks cannot split"), replace=True)
    with pytest.raises(ValueError, match=f"the built-in '{MADE_UP}' planner cannot shard this model: its made-up"):
        resolve_plan(model, tensor_parallel_size=2)


def test_the_made_up_family_is_gone_after_its_test():
    assert family(MADE_UP) is None and MADE_UP not in CONFIG_MAPPING


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(preset={"layers.*.up": "colwise"}), "missing 1 required keyword-only argument: 'model_type'"),
        (dict(model_type=MADE_UP), f"FamilySpec '{MADE_UP}' holds nothing: give one of preset, override, additions"),
        (dict(model_type=""), "FamilySpec(model_type=''): give the config's model_type, a string"),
        (
            dict(model_type=MADE_UP, preset={"layers.*.up": "colwize"}),
            f"FamilySpec '{MADE_UP}' preset: plan entry 'layers.*.up': unknown style 'colwize'; known styles: ",
        ),
        (
            dict(model_type=MADE_UP, preset={"embed": "embedding_rowwise"}, override={"embed": "embedding_rowwise"}),
            f"FamilySpec '{MADE_UP}' has a preset and an override",
        ),
        (dict(model_type=MADE_UP, variant={"a": "colwise"}), f"FamilySpec '{MADE_UP}' variant: give a function"),
    ],
)
def test_a_record_missing_what_it_needs_is_refused_in_one_line(fields, message):
    with pytest.raises((TypeError, ValueError)) as raised:
        FamilySpec(**fields)
    print(f"{fields}: {raised.value}")
    assert message in str(raised.value) and "\n" not in str(raised.value)


def test_a_second_record_for_one_model_type_is_refused():
    with pytest.raises(ValueError, match="model_type 'falcon' has a FamilySpec already: edit that record"):
        register(FamilySpec(model_type="falcon", zoo_fields={}))


@pytest.mark.parametrize("spec", registered(), ids=lambda spec: spec.model_type)
def test_every_record_is_a_transformers_family_and_sizes_valid_entries_for_its_tiny_config(spec):
    """A half-added family fails here: a model_type transformers does not know (its record is never read), or a
    `variant` that does not build valid entries from the family's tiny config (its default config where
    the tiny one does not build: NeoMME's rotary width)."""
    assert spec.model_type in CONFIG_MAPPING, f"'{spec.model_type}' is no transformers model_type"
    if spec.variant is not None:
        entries = spec.variant(_config(spec))
        for pattern, style in entries.items():
            check_style(pattern, style)


def _config(spec: FamilySpec) -> PretrainedConfig:
    try:
        return CONFIG_MAPPING[spec.model_type](**tiny_config(spec.model_type))
    except ValueError:
        return CONFIG_MAPPING[spec.model_type]()
