"""A family's built-in plan, read from its record (`families`): its preset, override or additions to Hugging Face's
plan, keyed as the model's modules (prefixed with the base model's name, the LM head added)."""

from __future__ import annotations

import torch.nn as nn

from tp_train.plan.deciding.families import FamilySpec, family_of

HEAD_STYLE = "colwise_gather_output"  # the LM head: split over the vocabulary, its logits gathered


def preset_plan(model: nn.Module) -> dict[str, str] | None:
    """The preset for `model.config.model_type`, with keys as `model`'s module names; None when there is none."""
    spec = family_of(model)
    if spec is None or spec.preset is None:
        return None
    _check_supported(spec, model, "preset")
    return _for_model(model, {**spec.preset, **(spec.variant(model.config) if spec.variant else {})}, head=True)


def check_shardable(model: nn.Module) -> None:
    """Raises a one-line `ValueError` for a model of a family tp_train cannot shard (a record's `unshardable`)."""
    spec = family_of(model)
    if spec is not None and spec.unshardable:
        _check_supported(spec, model, "planner")


def override_plan(model: nn.Module) -> dict[str, str] | None:
    """The head-aware plan that replaces Hugging Face's for `model`'s family (a record's `override`), or None."""
    spec = family_of(model)
    return _for_model(model, spec.override, head=True) if spec and spec.override else None


def plan_additions(model: nn.Module) -> dict[str, str]:
    """Entries to add to Hugging Face's plan for `model`'s family (a record's `additions`, and its `variant` for a
    family without a preset), keyed as `model`'s modules."""
    spec = family_of(model)
    if spec is None:
        return {}
    base = dict(spec.additions or {})
    if spec.preset is None:
        _check_supported(spec, model, "plan additions")
        base |= spec.variant(model.config) if spec.variant else {}
    return _for_model(model, base, head=False) if base else {}


def _check_supported(spec: FamilySpec, model: nn.Module, what: str) -> None:
    reason = spec.unshardable or (spec.unsupported(model) if spec.unsupported else None)
    if reason:
        raise ValueError(f"the built-in '{spec.model_type}' {what} cannot shard this model: {reason}")


def _for_model(model: nn.Module, base: dict[str, str], head: bool) -> dict[str, str]:
    """`base` (keys relative to the base model) keyed as `model`'s module names, with the LM head when `head`."""
    prefix = getattr(model, "base_model_prefix", "")
    prefix = f"{prefix}." if prefix and hasattr(model, prefix) else ""
    plan = {prefix + pattern: style for pattern, style in base.items()}
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
