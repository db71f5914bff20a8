"""One record per Hugging Face `model_type` (`FamilySpec`): everything tp_train knows about a family, as data, and
the registry that the presets, the planner and the zoo all read through `family`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields

import torch.nn as nn

from tp_train.plan.styles import check_style

PLAN_FIELDS = ("preset", "override", "additions")  # the fields holding plan entries (pattern -> style)


@dataclass(frozen=True, kw_only=True)
class FamilySpec:
    """What tp_train knows about one Hugging Face family. Plan keys are relative to the base model, as in Hugging
    Face's own plans (`tp_train.plan.deciding.resolve` prefixes them and adds the LM head). Give `model_type` and at
    least one of the others; a style tp_train does not know is refused when the record is built."""

    model_type: str  # the config's `model_type`
    preset: Mapping[str, str] | None = None  # the whole plan, for a family whose config ships no base_model_tp_plan
    override: Mapping[str, str] | None = None  # a head-aware plan used in place of Hugging Face's (wasteful) one
    additions: Mapping[str, str] | None = None  # entries added to, or correcting, Hugging Face's plan
    variant: Callable[..., dict[str, str]] | None = None  # config -> entries the config sizes or places, joining
    # the preset's or the additions'
    unsupported: Callable[[nn.Module], str | None] | None = None  # model -> why its preset or additions cannot
    # shard this model (a config, how it was built), or None
    unshardable: str | None = None  # why no plan of tp_train's shards the family: refused but for an explicit plan
    zoo_fields: Mapping[str, object] | None = None  # the zoo's tiny config: fields the family's layout needs
    positions_after_padding: bool | None = None  # its learned positions count on from the pad id (RoBERTa's):
    # a block of n tokens takes n + pad id + 1 rows of the position table

    def __post_init__(self) -> None:
        if not isinstance(self.model_type, str) or not self.model_type:
            raise ValueError(f"FamilySpec(model_type={self.model_type!r}): give the config's model_type, a string")
        knowledge = [field.name for field in fields(self) if field.name != "model_type"]
        if all(getattr(self, name) is None for name in knowledge):
            raise ValueError(f"FamilySpec '{self.model_type}' holds nothing: give one of {', '.join(knowledge)}")
        if self.preset is not None and self.override is not None:
            raise ValueError(
                f"FamilySpec '{self.model_type}' has a preset and an override: a preset is for a config without "
                f"Hugging Face's plan, an override replaces that plan; give one"
            )
        for name in PLAN_FIELDS:
            for pattern, style in (getattr(self, name) or {}).items():
                try:
                    check_style(pattern, style)
                except ValueError as error:
                    raise ValueError(f"FamilySpec '{self.model_type}' {name}: {error}") from None
        for name in ("variant", "unsupported"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise ValueError(f"FamilySpec '{self.model_type}' {name}: give a function, not {getattr(self, name)!r}")


_REGISTRY: dict[str, FamilySpec] = {}


def register(spec: FamilySpec, replace: bool = False) -> FamilySpec:
    """Adds `spec` to the registry; a second record for one model_type is refused unless `replace`."""
    if spec.model_type in _REGISTRY and not replace:
        raise ValueError(f"model_type '{spec.model_type}' has a FamilySpec already: edit that record")
    _REGISTRY[spec.model_type] = spec
    return spec


def unregister(model_type: str) -> FamilySpec:
    """Removes (and returns) `model_type`'s record."""
    return _REGISTRY.pop(model_type)


def family(model_type: str | None) -> FamilySpec | None:
    """The record for `model_type`, or None where tp_train knows nothing of the family beyond its own plan."""
    return _REGISTRY.get(model_type)


def family_of(model: nn.Module) -> FamilySpec | None:
    """The record for `model.config.model_type`, or None."""
    return family(getattr(getattr(model, "config", None), "model_type", None))


def registered() -> tuple[FamilySpec, ...]:
    """Every record, in the order registered."""
    return tuple(_REGISTRY.values())
