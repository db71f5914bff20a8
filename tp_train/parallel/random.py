"""Dropout randomness under tensor parallelism, on CPU and CUDA."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.agreement import before_collective
from tp_train.parallel.fake_ranks import real_values

REPLICATED, SHARDED = "replicated", "sharded"
_SHARDED_SEED_OFFSET = 2718  # Megatron's offset between the data-parallel and model-parallel seeds


def _get_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def sync_default_generator(group: ProcessGroup, device: torch.device) -> None:
    """Sets `device`'s default generator on every rank of `group` to the group's first rank's (a collective)."""
    with real_values():  # a generator's state is set from it: real in a simulation too
        state = _get_state(device).to(device)  # generator states live on the CPU; NCCL needs the device
        before_collective()
        dist.broadcast(state, group=group, group_src=0)
        _set_state(device, state.cpu())


class TensorParallelRNG:
    """The two dropout streams of one TP group on one device. Creating it is a collective over `group`."""

    def __init__(self, group: ProcessGroup, device: torch.device, dropout: bool = True):
        """`dropout`: whether the model may draw dropout masks (`may_draw_dropout`); when False, forwards skip the
        stream switches."""
        self.device = device
        self.dropout = dropout
        self.sync_replicated(group)
        with real_values():
            # An unseeded process's initial seed is any 64-bit value: fold it into int64's range.
            seed = torch.tensor([torch.initial_seed() % 2**63], dtype=torch.int64, device=device)
            before_collective()
            dist.broadcast(seed, group=group, group_src=0)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self._manual_seed(int(seed) + _SHARDED_SEED_OFFSET + dist.get_rank(group))
                self._states = {SHARDED: _get_state(device)}
        self._stack = [REPLICATED]

    def _manual_seed(self, seed: int) -> None:
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def sync_replicated(self, group: ProcessGroup) -> None:
        """Makes the replicated stream (the default generator) identical on every rank of `group`."""
        sync_default_generator(group, self.device)

    def enter(self, region: str) -> None:
        """Switches the default generator to `region`'s stream until the matching `exit`; a model that draws no
        dropout stays in the replicated stream (no switch per module, eager or compiled)."""
        if self.dropout:
            self._enter(region)

    def exit(self) -> None:
        if self.dropout:
            self._exit()

    def _enter(self, region: str) -> None:
        current = self._stack[-1]
        self._stack.append(region)
        if region != current:
            self._states[current] = _get_state(self.device)
            _set_state(self.device, self._states[region])

    def _exit(self) -> None:
        region = self._stack.pop()
        previous = self._stack[-1]
        if region != previous:
            self._states[region] = _get_state(self.device)
            _set_state(self.device, self._states[previous])

    def separate_data_parallel_replicas(self, data_parallel_rank: int) -> None:
        """Gives each data-parallel replica its own dropout masks in both streams (replicas see different batches;
        the same masks would tie their noise together). Each stream is reseeded from its own next draw plus the
        rank, so the replicated stream stays identical across the TP group (its ranks share a data-parallel rank)
        and replica 0 keeps its streams. Call once the weights are initialised: they draw from the replicated
        stream and must agree across replicas."""
        if data_parallel_rank == 0:
            return
        for region in (REPLICATED, SHARDED):
            self._enter(region)
            with real_values():  # a seed: real in a simulation too
                self._manual_seed(int(torch.randint(2**62, ())) + data_parallel_rank)
            self._exit()

    def run_in(self, module: nn.Module, region: str) -> None:
        """Runs every forward of `module` in `region`'s stream (nothing to run when the model draws no dropout)."""
        if not self.dropout:
            return
        module.register_forward_pre_hook(lambda *_: self.enter(region))
        module.register_forward_hook(lambda *_: self.exit(), always_call=True)

    def get_state(self) -> tuple:
        """Both streams and the region stack: what a recomputation (activation checkpointing) must start from."""
        return list(self._stack), dict(self._states), _get_state(self.device)

    def set_state(self, state: tuple) -> None:
        stack, states, current = state
        self._stack, self._states = list(stack), dict(states)
        _set_state(self.device, current)

    @contextmanager
    def replay(self, state: tuple) -> Iterator[None]:
        """Runs the body from `state` (from `get_state`), so it draws the same masks in both streams as it did
        then; the live streams are restored afterwards, untouched."""
        live = self.get_state()
        self.set_state(state)
        try:
            yield
        finally:
            self.set_state(live)


def may_draw_dropout(model: nn.Module) -> bool:
    """Whether `model` may draw dropout masks: it has an `nn.Dropout`-like module (an attribute `p`) with a nonzero
    rate, or a module or config holds a nonzero number under a name containing "dropout" (the rates Hugging Face
    attention passes to `F.dropout`)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            return True
        for owner in (module, getattr(module, "config", None)):
            for name, value in vars(owner).items() if owner is not None and hasattr(owner, "__dict__") else ():
                if "dropout" in name.lower() and isinstance(value, (int, float)) and not isinstance(value, bool):
                    if value > 0:
                        return True
    return False
