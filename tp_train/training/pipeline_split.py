"""Where a model splits into pipeline stages, decided as data (`PipelineSplit`): which of its repeated blocks each
stage runs, and which modules outside the blocks run before them (the embedding, on the first stage) and after them
(the final norm and the head, on the last stage).

Deciding only: `tp_train.parallel.pipeline` cuts a model along a split and runs the stages. The blocks are the ones
the planner finds (`tp_train.plan.layout`); stages are balanced by parameters, the embedding counting as the first
stage's work and the head as the last's. An explicit split (`pipeline_split`: blocks per stage) overrides it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.pipeline.split import PipelineSplit
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.layout import blocks_if_any
from tp_train.plan.probe import forward_without_cache, hooks_removed
from tp_train.plan.probe_input import probe_input


def find_blocks(model: nn.Module) -> str:
    """The name of `model`'s nn.ModuleList of repeated blocks, found as the planner finds them (the list holding the
    plan's parallel linears); a one-line `ValueError` naming the model and what to write instead when there is none."""
    try:
        plan, _ = resolve_plan(model, None, tensor_parallel_size=1)
        blocks = blocks_if_any(model, match_plan(model, plan, 1))
    except ValueError as error:
        blocks, why = [], f" ({str(error).splitlines()[0]})"
    else:
        why = ""
    if not blocks:
        raise ValueError(
            f"pipeline parallelism: no repeated blocks found in {type(model).__name__}{why}; give the model a "
            f"`tp_plan` naming its blocks' linears (e.g. {{'layers.*.mlp.up': 'colwise', ...}}) with the blocks in "
            f"one nn.ModuleList"
        )
    return blocks[0].rpartition(".")[0]


def count_blocks(model: nn.Module, blocks: str | None = None) -> tuple[int, str]:
    """`model`'s repeated blocks (`blocks`, by default `find_blocks`'): how many, and where, as
    `ParallelDims.validate`'s `blocks` takes them (e.g. (2, "GPT's 'blocks'"))."""
    blocks = blocks or find_blocks(model)
    return len(model.get_submodule(blocks)), _where(model, blocks)


def _where(model: nn.Module, blocks: str) -> str:
    return f"{type(model).__name__}'s '{blocks}'"


def plan_pipeline_split(
    model: nn.Module, num_stages: int, explicit: list[int] | tuple[int, ...] | None = None, blocks: str | None = None
) -> PipelineSplit:
    """The split of `model` into `num_stages` stages: `explicit` blocks per stage (e.g. [3, 2]) when given, else the
    model's own `pipeline_split` attribute (data beside its `tp_plan`, for that many stages), else the contiguous
    split whose heaviest stage holds the fewest parameters. One-line `ValueError` when the stages
    outnumber the blocks (`ParallelDims.check_blocks`) or `explicit` does not add up to them."""
    blocks = blocks or find_blocks(model)
    block_list = model.get_submodule(blocks)
    count = len(block_list)
    ParallelDims(pp=num_stages).check_blocks(count, _where(model, blocks))
    before, after = _outside_blocks(model, blocks)
    own = getattr(model, "pipeline_split", None)
    if explicit is None and own is not None and len(own) == num_stages:
        explicit = own
    if explicit is not None:
        sizes = list(explicit)
        if len(sizes) != num_stages or sum(sizes) != count or min(sizes) < 1:
            raise ValueError(
                f"pipeline_split={sizes}: give {num_stages} positive block counts, one per stage, adding up to "
                f"the {count} blocks of '{blocks}'"
            )
    else:
        sizes = balanced_sizes(*stage_weights(model, blocks, before, after), num_stages)
    starts = [sum(sizes[:stage]) for stage in range(num_stages)]
    stages = tuple(tuple(range(start, start + size)) for start, size in zip(starts, sizes, strict=True))
    return PipelineSplit(blocks, stages, tuple(before), tuple(after))


def _outside_blocks(model: nn.Module, blocks: str) -> tuple[list[str], list[str]]:
    """Modules that hold parameters of their own outside the blocks: those whose forward begins before the first
    block's in a forward of the model (`_started_before_blocks`), and the rest, which run after the blocks. Where
    that forward cannot run, registration order stands in for call order (embeddings, blocks, final norm, head: the
    order of the models we know)."""
    started = _started_before_blocks(model, blocks)
    before, after, seen_blocks = [], [], False
    for name, module in model.named_modules():
        if name == blocks or name.startswith(blocks + "."):
            seen_blocks = True
            continue
        if next(module.parameters(recurse=False), None) is None:
            continue
        if name and blocks.startswith(name + "."):
            before.append(name)  # an ancestor of the block list holding parameters of its own: the first stage's
            continue
        runs_before = (name in started) if started is not None else not seen_blocks
        (before if runs_before else after).append(name)
    return before, after


class _BlocksReached(Exception):  # noqa: N818 - control flow: the first block is about to run
    pass


def stage_weights(
    model: nn.Module, blocks: str | None = None, before: list[str] | None = None, after: list[str] | None = None
) -> tuple[list[int], int, int]:
    """What the balanced split weighs: the parameters of each of `model`'s blocks, of the modules that run before
    them (the first stage's) and of those after them (the last stage's)."""
    blocks = blocks or find_blocks(model)
    if before is None or after is None:
        before, after = _outside_blocks(model, blocks)
    weights = [_parameters(block) for block in model.get_submodule(blocks)]
    first = sum(_parameters(model.get_submodule(name), recurse=False) for name in before)
    last = sum(_parameters(model.get_submodule(name), recurse=False) for name in after)
    return weights, first, last


def _started_before_blocks(model: nn.Module, blocks: str) -> set[str] | None:
    """The names of the modules whose forward begins before the first block's, in a forward of `model` (where its
    parameters are: on the meta device for a model built there) on its probe input, stopped there; None where that
    forward fails before reaching the blocks."""
    first = next(iter(model.get_submodule(blocks)))
    started: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda *_, name=name: started.append(name))
        for name, module in model.named_modules()
        if name and module is not first
    ]

    def stop(*_):
        raise _BlocksReached

    handles.append(first.register_forward_pre_hook(stop))
    try:
        with torch.no_grad(), hooks_removed(handles):
            forward_without_cache(model, probe_input(model))
    except _BlocksReached:
        return set(started)
    except Exception:  # noqa: BLE001 - a forward that needs more than a probe input: registration order instead
        return None
    return None


def _parameters(module: nn.Module, recurse: bool = True) -> int:
    return sum(p.numel() for p in module.parameters(recurse=recurse))


def balanced_sizes(weights: list[int], first: int, last: int, stages: int) -> list[int]:
    """Blocks per stage (each at least one, contiguous) minimising the heaviest stage, where the first stage also
    carries `first` and the last `last` (dynamic programming over split points)."""
    count = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    infinite = float("inf")
    # best[s][i]: the smallest heaviest-stage load placing blocks[:i] on stages[:s]; cut[s][i]: where stage s-1 starts
    best = [[infinite] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for stage in range(1, stages + 1):
        for end in range(stage, count - (stages - stage) + 1):
            for start in range(stage - 1, end):
                load = prefix[end] - prefix[start]
                load += first if stage == 1 else 0
                load += last if stage == stages else 0
                value = max(best[stage - 1][start], load)
                if value < best[stage][end]:
                    best[stage][end], cut[stage][end] = value, start
    sizes, end = [], count
    for stage in range(stages, 0, -1):
        start = cut[stage][end]
        sizes.append(end - start)
        end = start
    return sizes[::-1]
