"""Launching ranks (from a Hydra app, or spawned) and where they meet: `TensorParallelStrategy`'s launch hooks
(`LaunchHooks`) and its launchers."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _init_dist_connection, _set_num_threads_if_needed
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.distributed.distributed_c10d import default_pg_timeout
from typing_extensions import override

from tp_train.errors import CheckpointError, DiskFullError
from tp_train.lightning import rendezvous, watchdog
from tp_train.parallel.mesh import first_rank_decides


def _hydra_job_command(local_rank: int) -> tuple[list[str], str]:
    """The command and working directory that re-run this Hydra job (not the sweep) as rank `local_rank`."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.utils import get_original_cwd, to_absolute_path

    import __main__

    hydra = HydraConfig.get()
    if __main__.__spec__ is None:
        command = [sys.executable, to_absolute_path(sys.argv[0])]
    else:
        command = [sys.executable, "-m", __main__.__spec__.name]
    command += list(hydra.overrides.task)
    command += [
        f'hydra.run.dir="{hydra.runtime.output_dir}"',
        f"hydra.job.name={hydra.job.name}_rank{local_rank}",
        "hydra.output_subdir=null",  # the parent already wrote the job's config
    ]
    return command, get_original_cwd()


class HydraJobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, with children that re-run the current Hydra job only, and a watchdog that
    ends the job when any rank dies. Node 0's launcher hosts the store its ranks meet at before starting them
    (`rendezvous.host_store`)."""

    def __init__(self, *args: Any, timeout: timedelta, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout = timeout

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        self.cluster_environment.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        first_rank = self.cluster_environment.node_rank() * self.num_processes
        own_rank = first_rank + self.cluster_environment.local_rank()
        children = None
        if not self.cluster_environment.creates_processes_externally:
            self._call_children_scripts()
            children = watchdog.ChildRanks(self.procs, list(range(first_rank + 1, first_rank + len(self.procs) + 1)),
                                           own_rank)  # fmt: skip
            children.watch()
            self.children = children  # the hang detector ends them too (tp_train.lightning.hang)
        elif watchdog.LAUNCHER_PID in os.environ:  # a child of HydraJobLauncher
            watchdog.watch_launcher(own_rank)
        _set_num_threads_if_needed(num_processes=self.num_processes)
        try:
            return function(*args, **kwargs)
        except (CheckpointError, DiskFullError):  # the same on every rank; train.py reports it once, from rank 0
            if children is not None:
                children.stop()
            raise
        except Exception as error:
            if children is not None:
                children.on_own_failure(error)
            else:
                watchdog.on_child_failure(own_rank, error)
            raise

    @override
    def _call_children_scripts(self) -> None:
        os.environ[watchdog.LAUNCHER_PID] = str(os.getpid())  # in the children's environment only
        if self.cluster_environment.node_rank() == 0:
            rendezvous.host_store(self.cluster_environment, self.timeout)  # this process is rank 0: it keeps it
        try:
            with mock.patch.object(subprocess_script, "_hydra_subprocess_cmd", _hydra_job_command):
                super()._call_children_scripts()
        finally:
            del os.environ[watchdog.LAUNCHER_PID]


class ShardedMultiProcessingLauncher(_MultiProcessingLauncher):
    """Spawn/fork launcher that sends no weights back: the main process holds the unsharded model, into which a
    rank's shards do not load. Read trained weights from a checkpoint instead. Node 0's launching process hosts
    the store the ranks meet at, from before they start until they end (`rendezvous.host_store`)."""

    @override
    def launch(self, function: Callable, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        environment = self._strategy.cluster_environment
        if environment.node_rank() != 0:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        port = rendezvous.host_store(environment, self._strategy.launch.timeout)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            rendezvous.release_store(port)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any):
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None:
            return output
        self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
        return output._replace(weights_path=None)


class LaunchHooks:
    """The launch hooks `TensorParallelStrategy` overrides (a mixin before DDPStrategy): its launcher (one of the two
    above), the store its ranks meet at (`launch`), and the process group made on that store."""

    _launch: rendezvous.Rendezvous | None = None  # this launch's store (this round's, under torchrun)

    @override
    def setup_distributed(self) -> None:
        # Lightning's, with the store made here: under torchrun, one scoped to this restart round (see
        # tp_train.lightning.rendezvous), which the process group and device mesh then use.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id,
            store=self.launch.store,
        )  # fmt: skip

    def rank_zero_decides(self, decide: Callable[[], Any]) -> Any:
        """`decide()` taken once for the whole job, on global rank 0, and returned on every rank (a JSON value),
        e.g. which checkpoint to resume: through the launch's store before the process group exists
        (`tp_train.lightning.rendezvous.Rendezvous.rank_zero_decides`), by broadcast once it does."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return first_rank_decides(decide)
        return self.launch.rank_zero_decides(decide)

    @property
    def launch(self) -> rendezvous.Rendezvous:
        """This launch's rendezvous: its store, shared by every rank (`tp_train.lightning.hang` beats through it)."""
        if self._launch is None:
            self._launch = rendezvous.Rendezvous(self.cluster_environment, self._timeout or default_pg_timeout)
        return self._launch

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = ShardedMultiProcessingLauncher(self, start_method=self._start_method)
        else:
            self._launcher = HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                              timeout=self._timeout or default_pg_timeout)  # fmt: skip
