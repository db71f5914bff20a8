"""The checkpoint hooks `TensorParallelStrategy` overrides (a mixin before DDPStrategy): a DCP directory every rank
writes its shards into, loading at any dp x tp, Lightning's metadata alongside (docs/checkpoints-and-faults.md); or
one consolidated file with `save_distributed_checkpoint=False`; written in the background with `async_checkpoint`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from typing_extensions import override

from tp_train.checkpoint import consolidated, on_disk
from tp_train.checkpoint import dcp as checkpoint_io
from tp_train.checkpoint.async_writer import AsyncCheckpointWriter


class CheckpointHooks:
    """Mixin for a Lightning strategy holding `device_mesh`, `save_distributed_checkpoint`, `async_checkpoint`,
    `trust_checkpoint` and `_checkpoint_writer` (None until the first asynchronous save)."""

    _checkpoint_writer: AsyncCheckpointWriter | None = None

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the sharded model and its optimizers

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint already did

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # the model is saved shard by shard in save_checkpoint

    @override
    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # likewise

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("TensorParallelStrategy.save_checkpoint does not take storage_options")
        path = Path(self.broadcast(str(filepath)))
        checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        if not self.save_distributed_checkpoint:  # one file, the full state, from rank 0
            consolidated.save(path, self.lightning_module, self.optimizers, self.device_mesh, extra=checkpoint)
            return
        if self.async_checkpoint and self._checkpoint_writer is None:
            self._checkpoint_writer = AsyncCheckpointWriter()  # a collective: every rank saves together
        writer = self._checkpoint_writer if self.async_checkpoint else None
        checkpoint_io.save(
            path, self.lightning_module, self.optimizers, self.device_mesh, extra=checkpoint, writer=writer
        )

    @override
    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        AsyncCheckpointWriter.wait_all()  # this strategy's saves, and another trainer's in this process
        path = Path(self.broadcast(str(checkpoint_path)))
        load = consolidated.load if path.is_file() else checkpoint_io.load  # a file: save_distributed_checkpoint=False
        return load(path, self.lightning_module, self.optimizers, self.device_mesh, self.trust_checkpoint)

    def wait_for_checkpoints(self) -> None:
        """Blocks until every checkpoint saved so far is written (with `async_checkpoint`, in the background)."""
        if self._checkpoint_writer is not None:
            self._checkpoint_writer.wait()

    @override
    def teardown(self) -> None:
        self.wait_for_checkpoints()  # the last checkpoint is complete before the run ends
        super().teardown()

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass  # load_checkpoint loaded the shards in place

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    @override
    def remove_checkpoint(self, filepath: Any) -> None:
        if not self.is_global_zero:
            return
        if self._checkpoint_writer is None:
            on_disk.remove(Path(filepath))
        else:  # after the writes submitted before (it may be one of them)
            self._checkpoint_writer.run_later(lambda: on_disk.remove(Path(filepath)))
