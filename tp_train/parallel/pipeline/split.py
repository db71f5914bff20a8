"""A model's split into pipeline stages, as data: what `tp_train.training.pipeline_split` decides and
`tp_train.parallel.pipeline` cuts along."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineSplit:
    blocks: str  # the nn.ModuleList holding the repeated blocks, e.g. "blocks" or "model.layers"
    stages: tuple[tuple[int, ...], ...]  # each stage's block indices, contiguous and in order
    before: tuple[str, ...]  # modules holding parameters that run before the blocks: the first stage's
    after: tuple[str, ...]  # modules holding parameters that run after the blocks: the last stage's

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def stage_modules(self, stage: int) -> list[str]:
        """The names of the modules stage `stage` holds (its blocks, and before/after where it is first/last)."""
        names = [f"{self.blocks}.{index}" for index in self.stages[stage]]
        before = list(self.before) if stage == 0 else []
        after = list(self.after) if stage == self.num_stages - 1 else []
        return before + names + after


def skipped(name: str, skip: Collection[str]) -> bool:
    """Whether module `name` is one of `skip` (modules other pipeline stages hold) or inside one."""
    return any(name == other or name.startswith(other + ".") for other in skip)


def within(prefix: str, names: Collection[str]) -> list[str]:
    """`names` (of modules of a root) relative to its submodule `prefix`, those inside it."""
    if not prefix:
        return list(names)
    return [name.removeprefix(prefix + ".") for name in names if name.startswith(prefix + ".")]
