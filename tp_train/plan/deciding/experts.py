"""Where a model's experts are, decided on the model as written (it may be on the meta device), before anything is
sharded: the tensor-parallel plan leaves them whole under expert parallelism (`keep_experts_whole`); whether an
expert-parallel size fits them is the training layer's (`tp_train.training.experts.check_expert_parallel`).

An experts module is recognised by its shape, not by its family: a module with an integer `num_experts` whose own
parameters include one stacked over its experts (`(num_experts, ...)`), called as `(hidden (T, D), top_k_index
(T, k), top_k_weights (T, k))`. That is `models.moe.Experts` and Hugging Face's `MixtralExperts`, `Qwen2MoeExperts`,
`Qwen3MoeExperts`, `OlmoeExperts` and `GptOssExperts` (transformers 5): their routers stay the model's own code.
"""

from __future__ import annotations

import inspect

import torch.nn as nn

from tp_train.plan.styles import pattern_matches


def find_experts(model: nn.Module) -> dict[str, int]:
    """{name of each experts module in `model`: its number of experts}, outermost first."""
    found: dict[str, int] = {}
    for name, module in model.named_modules():
        experts = getattr(module, "num_experts", None)
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            continue
        own = module.named_parameters(recurse=False)
        stacked = any(param.dim() >= 2 and param.shape[0] == experts for _, param in own)
        if stacked and _takes_routes(module):  # a router holds (num_experts, D) too, but takes the tokens only
            found[name] = experts
    return found


def _takes_routes(module: nn.Module) -> bool:
    """The module's forward takes (hidden, top_k_index, top_k_weights): three positional arguments or more."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in parameters)


def keep_experts_whole(model: nn.Module, plan: dict[str, str]) -> tuple[dict[str, str], list[str]]:
    """`plan` without its entries on the experts modules (`find_experts`) or anything inside them, and those entries'
    patterns: under expert parallelism each rank holds whole experts, so the tensor-parallel plan splits the
    attention and the dense MLPs only (Megatron-Core's expert tensor parallelism 1, torchtitan's layout). One rule
    for every family: a family's record and Hugging Face's plans need no second, expert-parallel plan."""
    names = []
    for experts in find_experts(model):
        module = model.get_submodule(experts)
        names += [experts, *(f"{experts}.{name}" for name, _ in (*module.named_modules(), *module.named_parameters()))]
    dropped = [pattern for pattern in plan if any(pattern_matches(pattern, name) for name in names)]
    return {pattern: style for pattern, style in plan.items() if pattern not in dropped}, dropped
