"""torch's pipeline schedules run on one simulated rank (`tp_train.tools.simulate`): what crosses to other ranks is
answered here instead of over the fake group, which carries no values.

torch's schedule, before its first step, has its stages vote over the pipeline group on how to learn their
neighbours' shapes (a flag read with `.item()`), then sends each stage's output shapes to the next stage and its
gradients' shapes to the one before (`send_object_list`). On one simulated rank:
- the vote is skipped: every stage infers its shapes by running (torch's "dynamic" mode, as real ranks of our
  stages, which pass no example shapes, choose);
- a stage receives as its input the shapes of the first stage's output, recorded by a first pass on the first
  pipeline rank (`simulate._first_boundary`): every boundary of a model cut between its blocks carries the same
  hidden state. Each stage this rank holds checks that its own output matches (one that does not is refused in one
  line);
- a stage receives as its output's gradient the shapes of its own output (a gradient is shaped as its tensor);
- a send on the fake group completes at once and keeps nothing; a real one (gloo's, NCCL's) keeps its tensor until the
  schedule waits on it, which torch's multi-stage schedules do at the end of the step: the sends here keep theirs
  until then too (`_HeldUntilWaited`).
Everything else is torch's own: the recv buffers it allocates per microbatch, the order of its actions, the
activations each microbatch holds until its backward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.pipelining import schedules as torch_schedules

from tp_train.parallel.pipeline import Pipeline

# What this reaches into torch's pipelining for: private names, as torch 2.13 has them.
_STAGE_METHODS = ("_send_meta", "_recv_meta", "_stage_meta")
_SCHEDULE_METHODS = ("_warmup_p2p",)


class _HeldUntilWaited:
    """A fake group's work that keeps the tensors of its operations until it is waited on, as a real one does."""

    def __init__(self, work, tensors: list) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args, **kwargs):
        self._tensors = None
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class FirstBoundaryFound(Exception):  # noqa: N818 - control flow: the first pass stops once it has the shapes
    def __init__(self, metas: tuple) -> None:
        super().__init__()
        self.metas = metas


@contextmanager
def simulated_pipeline(pipeline: Pipeline, boundary: tuple | None) -> Iterator[dict[int, tuple]]:
    """Runs `pipeline`'s schedule on this simulated rank (see the module docstring); `boundary` is the first stage's
    output shapes (None on the first pass, which raises `FirstBoundaryFound` with them once the first stage has
    inferred them). Yields {stage: the output shapes it sent}."""
    try:
        from torch.distributed.pipelining._utils import (
            InferenceMode,
            _derive_grad_metas,
            _StageBackwardMeta,
            _StageForwardMeta,
        )
    except ImportError:
        raise ValueError(_unsupported("its stage metadata (_StageForwardMeta, _StageBackwardMeta)")) from None
    sent: dict[int, tuple] = {}
    schedule = pipeline.torch_schedule
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    missing = [name for name in _SCHEDULE_METHODS if not hasattr(schedule, name)]
    missing += [name for name in _STAGE_METHODS if not hasattr(stages[0], name)]
    if missing or not hasattr(torch_schedules, "_batch_p2p"):
        raise ValueError(_unsupported(", ".join(missing) or "_batch_p2p"))

    def warmup_without_vote(stages, has_backward, p2p_done) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.DYNAMIC

    def patch(stage) -> None:
        def send_meta(meta: Any, dst_stage: int) -> None:
            if isinstance(meta, _StageForwardMeta):
                sent[stage.stage_index] = meta.forward_metas
                if boundary is None and stage.stage_index == 0:
                    raise FirstBoundaryFound(meta.forward_metas)

        def recv_meta(src_stage: int) -> Any:
            if src_stage > stage.stage_index:  # the gradients of this stage's outputs
                return _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))
            if boundary is None:
                raise RuntimeError("simulate_memory: the pipeline's first pass reached a stage after the first")
            return _StageForwardMeta(forward_metas=boundary)

        stage._send_meta, stage._recv_meta = send_meta, recv_meta

    for stage in stages:
        patch(stage)
    schedule._warmup_p2p = warmup_without_vote
    batch_p2p = torch_schedules._batch_p2p

    def holding_batch_p2p(p2p_ops, desc=None):
        tensors = [op.tensor for op in p2p_ops]
        return [_HeldUntilWaited(work, tensors) for work in batch_p2p(p2p_ops, desc)]

    torch_schedules._batch_p2p = holding_batch_p2p
    try:
        yield sent
    finally:
        torch_schedules._batch_p2p = batch_p2p


def _unsupported(missing: str) -> str:
    return (
        f"simulate_memory: pipelines are simulated through torch 2.13's pipelining internals, and torch "
        f"{torch.__version__} lacks {missing}; use estimate_memory for a pipeline"
    )
