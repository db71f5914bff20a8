"""One training step of any layout simulated in one process: the real sharding code (`parallelize_for_training`)
on fake tensors over torch's fake process group, its memory tracked by torch's `MemTracker`, at any world size and
for any rank, on this machine, with no rank started and no weight allocated.

What fake ranks cannot carry, and what is done instead:
- plan verification runs the model on real values: off (the plan is the model's own, or the one given);
- DDP's reducer needs real storage: the model is not wrapped, and its gradient buckets (one flat copy of the
  trainable parameters' gradients, torch's default) are added to the peak by arithmetic;
- a pipeline's stages exchange shapes over real groups: `pp > 1` is refused for now (`estimate_memory` still covers
  it, by formula);
- a forward whose shapes depend on the data (a mixture of experts' dropless routing: `nonzero`, `bincount`) cannot
  run on fake tensors: refused in one line naming the operation, until a routing assumption stands in for the data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.fake_ranks import FAKE_BACKEND
from tp_train.training.apply_order import TrainingOptions, parallelize_for_training

MIB = 2**20
SIMULATED_STEPS = 2  # the second step holds the optimizer's states the first one made


@dataclass(frozen=True)
class SimulatedMemory:
    """Bytes one rank holds at the simulated step's peak, by kind (MemTracker's categories at that moment)."""

    parameters: int  # FSDP2's gathered ones in use included
    gradients: int
    optimizer_states: int
    activations: int  # what the forward keeps for the backward
    temporaries: int  # the backward's working tensors (gradients of activations)
    buffers: int
    gradient_buckets: int  # DDP's, by arithmetic (see the module docstring)

    @property
    def peak(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def table(self, title: str = "simulated memory per rank") -> str:
        rows = [(f.name.replace("_", " "), getattr(self, f.name)) for f in fields(self)] + [("peak", self.peak)]
        width = max(len(name) for name, _ in rows)
        return "\n".join([f"{title}:", *(f"  {name:<{width}}  {value / MIB:10.1f} MiB" for name, value in rows)])


def simulate_memory(
    build: Callable[[], nn.Module],
    dims: ParallelDims,
    forward_backward: Callable[[nn.Module], object],
    options: TrainingOptions | None = None,
    rank: int = 0,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] = torch.optim.AdamW,
) -> SimulatedMemory:
    """The memory `rank` of a `dims` job holds at the peak of a training step.

    Args:
        build: makes the unsharded model (called under the fake mode: its weights hold no memory).
        dims: the degrees, validated (`ParallelDims.from_world(...)`); `pp` must be 1.
        forward_backward: `forward_backward(module)` runs one forward and backward on inputs it makes (fake too), in
            the contexts the real step uses (Lightning's autocast wraps the forward; the benchmark's, the backward too).
        options: as `TensorParallelStrategy` gives them; plan verification is switched off.
        optimizer: made over the sharded parameters; AdamW by default.
    """
    if dims.pp > 1:
        raise ValueError(f"simulate_memory: pp={dims.pp} is not simulated yet; use estimate_memory for a pipeline")
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"simulate_memory: rank={rank} is outside the world of {dims.world_size} ranks")
    if dist.is_initialized():
        raise RuntimeError(
            "simulate_memory: a process group is already initialised here; simulate before the ranks start, or in a "
            "process of its own"
        )
    options = options or TrainingOptions()
    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=dims.world_size)
    try:
        mesh = dims.build_mesh("cpu")
        with FakeTensorMode():
            model = build()
            training = parallelize_for_training(
                model, dims, mesh, torch.device("cpu"), replace(options, verify_plan=False), wrap_replicas=None
            )
            trainable = [param for param in model.parameters() if param.requires_grad]
            step_optimizer = optimizer(trainable)
            tracker = MemTracker()
            tracker.track_external(training.module, step_optimizer)
            with tracker:
                for _ in range(SIMULATED_STEPS):
                    tracker.reset_mod_stats()  # the module statistics of one step; the peak is kept across both
                    try:
                        forward_backward(training.module)
                    except (DataDependentOutputException, DynamicOutputShapeException) as error:
                        raise ValueError(
                            f"simulate_memory: {type(model).__name__}'s step has a shape that depends on the data "
                            f"({error.func}, e.g. a mixture of experts' routing), which fake tensors cannot "
                            f"simulate yet; use estimate_memory"
                        ) from None
                    step_optimizer.step()
                    step_optimizer.zero_grad()
            [peak] = tracker.get_tracker_snapshot("peak").values()
    finally:
        dist.destroy_process_group()
    replicated = dims.dp_cp > 1 and options.data_parallel == "ddp"
    return SimulatedMemory(
        parameters=peak.get("Parameter", 0),
        gradients=peak.get("Gradient", 0),
        optimizer_states=peak.get("Optstate", 0),
        activations=peak.get("Activation", 0),
        temporaries=peak.get("Temp", 0) + peak.get("Other", 0),
        buffers=peak.get("Buffer", 0),
        gradient_buckets=sum(_bytes(param) for param in trainable) if replicated else 0,
    )


def _bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2's DTensor: this rank's shard
    return local.numel() * local.element_size()
