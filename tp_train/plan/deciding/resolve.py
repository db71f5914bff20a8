"""Which plan a model gets: an explicit one, the model's own (`tp_plan`, Hugging Face's `base_model_tp_plan`, a
built-in preset read from its family's record), completed by the auto-planner when it shards no block, or the
auto-planner's alone."""

from __future__ import annotations

import torch.nn as nn

from tp_train.parallel.sharding import divisors
from tp_train.plan.deciding.autoplan import COMPLETED_SOURCE, INFERRED_SOURCE, InferredPlan, infer_plan
from tp_train.plan.deciding.coverage import covered_linears, in_repeated_block, sharded_parameters, whole_beyond_small
from tp_train.plan.deciding.experts import keep_experts_whole
from tp_train.plan.deciding.families import FamilySpec, family_of
from tp_train.plan.deciding.match import names_anything
from tp_train.plan.styles import (
    ALIASES,
    CONFIG_HEAD_FIELDS,
    KV_HEAD_ATTRIBUTES,
    LINEAR_STYLES,
    adapted_model,
    linear_shape,
    pattern_matches,
    split_style,
)

# How the source of a plan lists the entries it skipped (printed by `tp_train.parallelize` on rank 0).
SKIPPED = "skipped, as this config builds nothing they name:"
EXPERTS_KEPT_WHOLE = "the experts kept whole for expert parallelism, without"


def find_plan(model: nn.Module) -> tuple[dict[str, str], str] | None:
    """The model's own plan and where it came from: its `tp_plan`, the Hugging Face plan (`base_model_tp_plan`
    and the head's `_tp_plan`, as transformers merges them), or a built-in preset; None when it has none."""
    # transformers models expose their merged plan as both `tp_plan` (a property) and `_tp_plan`.
    hugging_face_plan = getattr(model, "_tp_plan", None)
    own_plan = getattr(model, "tp_plan", None)
    if own_plan and own_plan != hugging_face_plan:
        return dict(own_plan), f"{type(model).__name__}.tp_plan"
    override = override_plan(model) if hugging_face_plan else None
    if override:
        model_type = model.config.model_type
        return override, f"the built-in head-aware plan for model_type '{model_type}' (in place of Hugging Face's)"
    if hugging_face_plan:
        additions = plan_additions(model)
        source = f"{type(model).__name__}'s Hugging Face base_model_tp_plan"
        if additions:
            source += f", with the built-in additions for model_type '{model.config.model_type}'"
        return {**hugging_face_plan, **additions}, source
    preset = preset_plan(model)
    if preset:
        return preset, f"the built-in preset for model_type '{model.config.model_type}'"
    return None


def resolve_plan(
    model: nn.Module,
    plan: dict[str, str] | None = None,
    tensor_parallel_size: int | None = None,
    example_input=None,
    experts_whole: bool = False,
) -> tuple[dict[str, str], str]:
    """The plan to use and where it came from: the `plan` argument, else the model's own (`find_plan`), else the
    auto-planner's, checked at `tensor_parallel_size` on `example_input` (`tp_train.plan.deciding.autoplan`). The
    config's head counts are checked against `tensor_parallel_size` here, whichever plan it is. With `experts_whole`
    (expert parallelism) the model's own plan leaves its experts modules whole (`keep_experts_whole`); a `plan`
    argument is taken as written."""
    if tensor_parallel_size:
        check_config_heads(model, tensor_parallel_size)
    if plan:
        return dict(plan), "the plan argument"
    check_shardable(model)
    found = find_plan(model)
    if found is not None and not found[1].endswith(".tp_plan"):  # built for a family, not for this very model
        found = _fit_to_config(model, *found)
    if found is not None and experts_whole:
        kept, dropped = keep_experts_whole(model, found[0])
        if dropped:
            found = kept, f"{found[1]}; {EXPERTS_KEPT_WHOLE} {', '.join(repr(pattern) for pattern in dropped)}"
    if found is not None and not _leaves_blocks_untouched(model, found[0]):
        if _leaves_linears_whole(model, found[0]):
            return _completed(model, *found, tensor_parallel_size, example_input)
        return found
    try:
        inferred = infer_plan(model, tensor_parallel_size, example_input, given=found[0] if found else None)
    except ValueError as error:
        what = (
            f"{found[1]} shards no transformer block"
            if found
            else f"no tensor-parallel plan for {type(model).__name__}"
        )
        raise ValueError(
            f"{what}, and {error} (a `tp_plan` attribute or plan= looks like "
            f"{{'layers.*.mlp.up': 'colwise', 'layers.*.mlp.down': 'rowwise'}})"
        ) from None
    if found is None:
        return inferred, INFERRED_SOURCE
    # The model's own entries win; the auto-planner's fill in the blocks (a head-only plan, as LFM2's). An attention
    # kept whole is noted, whichever plan it completes.
    return InferredPlan({**inferred, **found[0]}, inferred.notes), f"{found[1]}, {COMPLETED_SOURCE}"


def check_config_heads(model: nn.Module, tp: int) -> None:
    """A one-line `ValueError` where a head count in `model.config` does not split over `tp` ranks (kv heads fewer
    than ranks are replicated where tp is a multiple of them)."""
    config = getattr(model, "config", None)
    for field in CONFIG_HEAD_FIELDS:
        value = getattr(config, field, None)
        if not isinstance(value, int) or not value % tp:
            continue
        if field in KV_HEAD_ATTRIBUTES:  # fewer kv heads than ranks: replicated, if each rank's heads use one
            if value and not tp % value:
                continue
            raise ValueError(
                f"config.{field}={value} neither divides nor is divisible by tensor_parallel_size={tp}: each rank "
                f"must hold whole kv heads, or replicas of one; use a tensor_parallel_size in {divisors(value)} or "
                f"a multiple of {value}"
            )
        raise ValueError(
            f"config.{field}={value} is not divisible by tensor_parallel_size={tp}: each rank must hold whole "
            f"heads; use a tensor_parallel_size in {divisors(value)}"
        )


def _completed(
    model: nn.Module, plan: dict[str, str], source: str, tensor_parallel_size: int | None, example_input=None
) -> tuple[dict[str, str], str]:
    """A model's own plan that shards some blocks, with the Linears it leaves whole in them (Hugging Face plans that
    shard only the MLP or the experts, not attention) paired by the auto-planner; its own entries untouched. When
    the auto-planner cannot pair them, the plan as it is, with one line saying what stays whole."""
    try:
        inferred = infer_plan(model, tensor_parallel_size, example_input, given=plan)
    except ValueError as error:
        note = f"note: what the plan leaves whole in its blocks stays whole on every rank: {error}"
        return InferredPlan(plan, [note]), f"{source}, {COMPLETED_SOURCE}"
    return InferredPlan({**inferred, **plan}, inferred.notes), f"{source}, {COMPLETED_SOURCE}"


def _leaves_linears_whole(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether a block Linear `plan` names nothing about leaves more than `SMALL_WHOLE` of its block whole."""
    covered, sharded = covered_linears(model, plan), sharded_parameters(model, plan)
    return any(whole_beyond_small(model, name, plan, sharded) for name in _block_linears(model) if name not in covered)


def _fit_to_config(model: nn.Module, plan: dict[str, str], source: str) -> tuple[dict[str, str], str]:
    """A family's plan fitted to this model: a key written relative to the base model (Llama4's text plan) resolved
    against it, and an entry naming nothing this config builds (an optional MoE or LoRA projection it turned off)
    skipped, as transformers does, and listed in the source (`SKIPPED`)."""
    # The base model: the child named by `base_model_prefix`, or a child model with a config of its own (Llama4's
    # `model`, whose class names its prefix 'language_model').
    prefixes = [name for name, child in model.named_children() if hasattr(child, "config")]
    fitted, skipped = {}, []
    for pattern, style in plan.items():
        prefixed = (f"{prefix}.{pattern}" for prefix in prefixes)
        if names_anything(model, pattern):
            fitted[pattern] = style
        elif (found := next((key for key in prefixed if names_anything(model, key)), None)) is not None:
            fitted.setdefault(found, style)  # an entry written with the prefix wins
        else:
            skipped.append(pattern)
    if skipped:
        source += f"; {SKIPPED} {', '.join(repr(pattern) for pattern in skipped)}"
    return fitted, source


def _leaves_blocks_untouched(model: nn.Module, plan: dict[str, str]) -> bool:
    """Whether `model` has Linears inside repeated blocks (`layers.0.mlp.up`) and `plan` shards none of them."""
    block_linears = _block_linears(model)
    names = {pattern: split_style(style)[0] for pattern, style in plan.items()}  # `colwise(64,64,16,16,8)` too
    sharding = [pattern for pattern, name in names.items() if ALIASES.get(name, name) in LINEAR_STYLES]
    return bool(block_linears) and not any(pattern_matches(p, name) for p in sharding for name in block_linears)


def _block_linears(model: nn.Module) -> list[str]:
    return [
        name for name, module in model.named_modules() if linear_shape(module) is not None and in_repeated_block(name)
    ]


def modules_with_plans(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost modules under (and including) `root` that carry a plan of their own, by name."""
    found = []

    def visit(name: str, module: nn.Module) -> None:
        wrapped = adapted_model(module)  # a peft wrapper forwards its model's plan, in its model's names
        if wrapped is not None:
            visit(f"{name}.{wrapped[0]}" if name else wrapped[0], wrapped[1])
            return
        if find_plan(module) is not None:
            found.append((name, module))
            return
        for child_name, child in module.named_children():
            visit(f"{name}.{child_name}" if name else child_name, child)

    visit("", root)
    return found


# A family's built-in plan, read from its record (`families`): its preset, override or additions to Hugging Face's
# plan, keyed as the model's modules (prefixed with the base model's name, the LM head added).


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
