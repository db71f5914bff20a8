"""One pipeline stage cut out of a whole model, and the forward that runs just its part of the model's own forward.

`cut_stage` deletes from a model (a copy, per stage) what other stages run, keeping every parameter's name: blocks
are removed from the block list without renumbering the rest (`blocks.3` stays `blocks.3`), so a stage's state dict
is a slice of the model's and checkpoints reshard across stages (torchtitan's way: split a copy, keep the names).

`StageForward` runs the model's own `forward` on a stage, so no model is rewritten for pipelining:
- a stage after the first receives the hidden state (and the model's first input, the token ids, passed along so
  the model's code before the blocks sees the shapes it expects); the modules before the blocks it does not hold
  return zeros of the hidden state's shape, and a hook on its first block replaces that block's input with the
  hidden state received;
- a stage before the last stops the forward at the end of its last block (a hook raises with the block's output),
  and sends that hidden state and the token ids on.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from tp_train.parallel.pipeline.split import PipelineSplit
from tp_train.parallel.pipeline.ties import TIED_NAMES, tied_parameters


class _Elsewhere(nn.Module):
    """Stands in for a module another stage holds. Before the blocks it returns zeros shaped like the hidden state
    the stage received (its value is replaced at the first block); after them it is never reached."""

    def __init__(self, name: str, hidden: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self._name = name
        self._hidden = hidden

    def forward(self, *args, **kwargs) -> torch.Tensor:
        if "value" not in self._hidden:
            raise RuntimeError(f"pipeline stage: '{self._name}' runs on another stage but was reached on this one")
        if "blocks_started" in self._hidden:  # split by registration order (a meta model), which is not call order
            raise RuntimeError(
                f"pipeline stage: '{self._name}' was taken for a module running before the blocks, but runs after "
                f"them; register the model's modules in the order its forward calls them"
            )
        return torch.zeros_like(self._hidden["value"]).detach()


class _StageEnd(Exception):  # noqa: N818 - control flow, not an error: the stage's last block has run
    def __init__(self, output) -> None:
        super().__init__()
        self.output = output


def cut_stage(model: nn.Module, split: PipelineSplit, stage: int) -> nn.Module:
    """Removes from `model` (in place: pass a copy) every block and outside module that stage `stage` does not run;
    the remaining parameters keep their names, and the whole model's names of its tied parameters are recorded as
    its `TIED_NAMES` attribute (checkpoints name a tied parameter by its first). Returns `model`."""
    return _cut(model, split, [stage])


def cut_stages(model: nn.Module, split: PipelineSplit, stages: list[int]) -> list[nn.Module]:
    """`model` cut in place to what `stages` (one rank's, e.g. 0 and 2 of 4 under Interleaved1F1B) run together,
    and for each stage a view of it running that stage alone: a shallow copy sharing the model's modules and
    parameters, whose block list holds the stage's blocks only and whose modules of other stages stand in as
    `_Elsewhere`. The model keeps every parameter the rank holds, once, under the model's names (what the
    optimizer and checkpoints see); one stage's view is the cut model itself."""
    _cut(model, split, stages)
    if len(stages) == 1:
        return [model]
    views = []
    for stage in stages:
        blocks = model.get_submodule(split.blocks)
        replaced: dict[str, nn.Module] = {split.blocks: _with_modules(blocks, {}, keep=split.stages[stage])}
        hidden: dict[str, torch.Tensor] = {}
        for name in _elsewhere(split, [stage]):
            replaced[name] = _Elsewhere(name, hidden)
        view = _with_modules(model, replaced)
        view._pipeline_hidden = hidden
        views.append(view)
    return views


def _elsewhere(split: PipelineSplit, stages: list[int]) -> list[str]:
    """The modules before and after the blocks that none of `stages` runs."""
    first, last = 0 in stages, split.num_stages - 1 in stages
    return ([] if first else list(split.before)) + ([] if last else list(split.after))


def _cut(model: nn.Module, split: PipelineSplit, stages: list[int]) -> nn.Module:
    # each name of a tied parameter -> all its names in the whole model (a stage may hold it under one only)
    setattr(model, TIED_NAMES, {name: tie.names for tie in tied_parameters(model) for name in tie.names})
    kept = {index for stage in stages for index in split.stages[stage]}
    block_list = model.get_submodule(split.blocks)
    for index in range(len(block_list)):
        if index not in kept:
            del block_list._modules[str(index)]  # not `del block_list[index]`: that renumbers the rest
    hidden: dict[str, torch.Tensor] = {}
    model._pipeline_hidden = hidden
    for name in _elsewhere(split, stages):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _Elsewhere(name, hidden))
    return model


def _with_modules(module: nn.Module, replaced: dict[str, nn.Module], keep=None) -> nn.Module:
    """A shallow copy of `module` with the submodules named (dotted) in `replaced` swapped in, each module on their
    paths copied alike; every other submodule, parameter and buffer shared. With `keep`, the copy's children are
    only those of the indices in `keep` (a block list's). Each copy has hooks of its own, starting as the module's:
    a hook registered on one stage's view (FSDP2's, wrapping each stage) must not run for the others'."""
    view = copy.copy(module)
    for key, value in vars(module).items():
        if "hooks" in key and isinstance(value, dict):
            view.__dict__[key] = copy.copy(value)
    children = dict(module._modules) if keep is None else {str(i): module._modules[str(i)] for i in keep}
    inner: dict[str, dict[str, nn.Module]] = {}
    for name, new in replaced.items():
        head, _, rest = name.partition(".")
        if rest:
            inner.setdefault(head, {})[rest] = new
        else:
            children[head] = new
    for head, deeper in inner.items():
        children[head] = _with_modules(module._modules[head], deeper)
    view.__dict__["_modules"] = children
    return view


class StageForward(nn.Module):
    """The module a `torch.distributed.pipelining.PipelineStage` runs for stage `stage` of `split`: `model` is the
    cut model (`cut_stage`). Inputs: the token ids (first stage) or (hidden, token ids); outputs: (hidden, token ids)
    or, on the last stage, the model's logits (the tensor it returns, or a Hugging Face output's `logits`).
    Parameters are the model's, under `module.`."""

    def __init__(self, model: nn.Module, split: PipelineSplit, stage: int) -> None:
        super().__init__()
        self.module = model
        self.first, self.last = stage == 0, stage == split.num_stages - 1
        blocks = model.get_submodule(split.blocks)
        self._hidden: dict[str, torch.Tensor] = model._pipeline_hidden
        self._output_type: type | None = None  # the model's output type where it is not a tensor (last stage)
        indices = split.stages[stage]
        if not self.first:
            blocks.get_submodule(str(indices[0])).register_forward_pre_hook(
                self._take_hidden, with_kwargs=True, prepend=True
            )  # before the model's own hooks
        if not self.last:
            blocks.get_submodule(str(indices[-1])).register_forward_hook(self._stop)

    def forward(self, *inputs: torch.Tensor):
        hidden, ids = (None, inputs[0]) if self.first else inputs
        if hidden is not None:
            self._hidden["value"] = hidden
        try:
            output = self.module(ids)
        except _StageEnd as end:
            return end.output, ids
        finally:
            self._hidden.pop("value", None)
            self._hidden.pop("blocks_started", None)
        if not self.last:
            raise RuntimeError("pipeline stage: the model's forward ended before this stage's last block ran")
        if isinstance(output, torch.Tensor):
            return output
        # A Hugging Face ModelOutput (logits, and a KV cache torch cannot send): the stage's output is the logits,
        # and `model_output` rebuilds the model's own type around them for code that reads `.logits`
        self._output_type = type(output)
        return output["logits"]

    def model_output(self, logits: torch.Tensor):
        """What the whole model returns, around the last stage's output `logits` (a Hugging Face `ModelOutput`
        with only its logits, or the tensor itself)."""
        return logits if self._output_type is None else self._output_type(logits=logits)

    def _take_hidden(self, module, args, kwargs):
        hidden = self._hidden["value"]
        self._hidden["blocks_started"] = hidden
        if args:
            return (hidden, *args[1:]), kwargs
        key = next(iter(kwargs))  # the block's first argument, passed by keyword
        return args, {**kwargs, key: hidden}

    def _stop(self, module, args, output):
        raise _StageEnd(output[0] if isinstance(output, tuple) else output)
