"""What each module `TensorParallelStrategy` shards is probed on: the arguments it takes when the LightningModule runs
on its own inputs.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
import torch.nn as nn
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed import ProcessGroup

from tp_train.errors import first_line
from tp_train.parallel.mesh import first_rank_decides
from tp_train.plan.probe_input import ProbeInput

EXAMPLES = 2  # examples of a batch kept for the probe
# The loop whose loader and step method give the first batch, by what the trainer is doing.
STAGES = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


class _Recorded(Exception):
    """Ends the LightningModule's run once every module to shard has been called."""


def example_inputs(
    trainer: pl.Trainer, root: pl.LightningModule, targets: list[tuple[str, nn.Module]], group: ProcessGroup
) -> dict[str, ProbeInput]:
    """{target name: the arguments it was first called with} (see the module docstring; a collective over `group`).

    Raises:
        ValueError: one line, when `example_input_array` is set and the LightningModule's forward fails on it before
            reaching any module to shard.
    """

    def record() -> dict[str, ProbeInput]:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):  # a loader's shuffle, dropout before a target: rank 0 only
            return _record(trainer, root, targets)

    return first_rank_decides(record, group)


def _record(trainer: pl.Trainer, root: pl.LightningModule, targets: list[tuple[str, nn.Module]]) -> dict:
    run, source = _run(trainer, root)
    if run is None:
        return {}
    recorded: dict[str, ProbeInput] = {}

    def hook(name):
        def record(module, args, kwargs):
            recorded.setdefault(name, ProbeInput(args, kwargs).map(lambda tensor: tensor.detach().cpu()))
            if len(recorded) == len(targets):
                raise _Recorded

        return record

    handles = [module.register_forward_pre_hook(hook(name), with_kwargs=True) for name, module in targets]
    try:
        with torch.no_grad():
            run()
    except _Recorded:
        pass
    except Exception as error:  # noqa: BLE001 - a step that cannot run outside the loop: the modules' defaults
        if source == "example_input_array" and not recorded:
            raise ValueError(
                f"example_input_array: {type(root).__name__}'s forward fails on it ({first_line(error)}); set it to "
                f"what forward takes (a tensor, a tuple of positional or a dict of keyword arguments), or to None"
            ) from None
    finally:
        for handle in handles:
            handle.remove()
    return {name: _first_examples(inputs) for name, inputs in recorded.items()}


def _run(trainer: pl.Trainer, root: pl.LightningModule):
    """What runs the LightningModule on its own inputs, and where they come from; (None, None) without any."""
    example = root.example_input_array
    if example is not None:
        return (lambda: ProbeInput.of(example).to(root.device)(root)), "example_input_array"
    stage = STAGES.get(trainer.state.fn)
    source = getattr(getattr(trainer, stage[0], None), "_data_source", None) if stage else None
    if source is None or not source.is_defined():
        return None, None
    loader = source.dataloader()
    while isinstance(loader, (list, tuple, dict)) and loader:  # several loaders: the first
        loader = next(iter(loader.values())) if isinstance(loader, dict) else loader[0]
    try:
        batch = next(iter(loader))
    except (StopIteration, TypeError):
        return None, None
    batch = trainer.strategy.batch_to_device(batch)
    return (lambda: getattr(root, stage[1])(batch, 0)), "the first batch"


def _first_examples(inputs: ProbeInput) -> ProbeInput:
    tensors = [tensor for tensor in inputs.tensors() if tensor.dim()]
    if not tensors:
        return inputs
    size = tensors[0].shape[0]
    return inputs.map(lambda tensor: tensor[:EXAMPLES] if tensor.dim() and tensor.shape[0] == size else tensor)
