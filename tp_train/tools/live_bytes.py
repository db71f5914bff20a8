"""The bytes of every live tensor storage while a step runs, by kind, and their sum at its peak: what the step
simulator reads (`tp_train.tools.simulate`).

torch's `MemTracker` classifies the same bytes through module hooks, which follow one call of each root module per
step; a pipeline calls each stage once per microbatch and runs backwards between forwards. Here the kind comes from
what a storage is instead: a parameter's, a gradient's (told at each new peak, from the parameters' `.grad`), an
optimizer state's, a model buffer's, one of the pipeline's receive buffers, or else a step's working tensor
(activations kept for the backward and the backward's temporaries). Works on fake tensors (their storages have a
size and no data) as on real ones.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

KINDS = PARAMETERS, GRADIENTS, OPTIMIZER_STATES, BUFFERS, RECEIVE_BUFFERS, WORKING = (
    "parameters", "gradients", "optimizer_states", "buffers", "receive_buffers", "working",
)  # fmt: skip


def _storages(tensor: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages holding `tensor`'s data: a wrapper subclass's (a DTensor's: this rank's shard) are its inner
    tensors'; the wrapper's own has none."""
    if is_traceable_wrapper_subclass(tensor):
        inner = [getattr(tensor, name) for name in tensor.__tensor_flatten__()[0]]
        return [storage for part in inner if isinstance(part, torch.Tensor) for storage in _storages(part)]
    return [tensor.untyped_storage()]


class LiveBytes(TorchDispatchMode):
    """Counts the live storages' bytes by kind while active; `peak` is the largest total seen and `at_peak` its
    bytes by kind. Tensors that exist before (parameters, states, buffers) are given with `hold`; the gradients of
    `parameters` are told from working tensors at each new peak (however they were set: accumulated by autograd, or
    assigned, as FSDP2 assigns its reduce-scattered shards)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._parameters = list(parameters)
        self._kind: dict[int, str] = {}  # id of a live storage -> its kind
        self._bytes: dict[int, int] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        self.live: Counter[str] = Counter()
        self.peak = 0
        self.at_peak: dict[str, int] = {}

    def hold(self, tensors: Iterable[torch.Tensor], kind: str) -> None:
        """Counts `tensors` (already allocated) as `kind`; a storage already counted takes the new kind."""
        for tensor in tensors:
            for storage in _storages(tensor):
                self._track(storage, kind)
        self._new_peak()

    def reset_peak(self) -> None:
        """Forgets the peak so far: the next one is of what runs from now on, over what lives now."""
        self.peak, self.at_peak = 0, {}
        self._new_peak()

    def _track(self, storage: torch.UntypedStorage, kind: str) -> None:
        key = id(storage)
        if key in self._kind:
            self.live[self._kind[key]] -= self._bytes[key]
        else:
            self._bytes[key] = storage.nbytes()
            self._finalizers[key] = weakref.finalize(storage, self._free, key)
        self._kind[key] = kind
        self.live[kind] += self._bytes[key]

    def _free(self, key: int) -> None:
        self.live[self._kind.pop(key)] -= self._bytes.pop(key)
        self._finalizers.pop(key, None)

    def _new_peak(self) -> None:
        if sum(self.live.values()) <= self.peak:
            return
        for param in self._parameters:
            for storage in _storages(param.grad) if param.grad is not None else []:
                if self._kind.get(id(storage)) != GRADIENTS:
                    self._track(storage, GRADIENTS)
        self.peak, self.at_peak = sum(self.live.values()), dict(self.live)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage resized in place (FSDP2 frees its gathered parameters so, and gathers them back)."""
        key = id(storage)
        if key not in self._kind:
            self._track(storage, WORKING)
        else:
            kind = self._kind[key]
            self.live[kind] += storage.nbytes() - self._bytes[key]
            self._bytes[key] = storage.nbytes()
        self._new_peak()

    def __enter__(self):
        # `UntypedStorage.resize_` is not an operator a dispatch mode sees: followed while active, as MemTracker does.
        self._own_resize = "resize_" in vars(torch.UntypedStorage)  # else inherited, and put back so
        resize = self._resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = resize(storage, size)
            self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            for storage in _storages(tensor) if isinstance(tensor, torch.Tensor) else []:
                key = id(storage)
                if key not in self._kind:
                    self._track(storage, WORKING)
                elif storage.nbytes() != self._bytes[key]:  # grown or shrunk in place (`resize_`, an `out=`)
                    self._resized(storage)
        self._new_peak()
        return out

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            if self._own_resize:
                torch.UntypedStorage.resize_ = self._resize
            else:
                del torch.UntypedStorage.resize_
            for finalizer in self._finalizers.values():
                finalizer.detach()
