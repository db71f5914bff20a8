"""Launching ranks from a Hydra app.

Lightning's subprocess launcher re-runs `sys.argv` for ranks 1..n-1. Under `python train.py -m tp=1,2` that is the
whole sweep, so every rank would start every job, and Lightning points the children at `hydra.run.dir` rather than
the job's own output directory. `HydraJobLauncher` builds each child's command from the job's own overrides and
output directory instead, so a child runs exactly its parent's job and writes where its parent does.
"""

from __future__ import annotations

import sys
from unittest import mock

from lightning.pytorch.strategies.launchers import subprocess_script
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from typing_extensions import override


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
    """Lightning's subprocess launcher, with children that re-run the current Hydra job only."""

    @override
    def _call_children_scripts(self) -> None:
        with mock.patch.object(subprocess_script, "_hydra_subprocess_cmd", _hydra_job_command):
            super()._call_children_scripts()
