"""`parallel=auto` is elastic: the same command restarted on another number of devices re-chooses the layout and
resumes from the last checkpoint, with its global batch and its place in the epoch kept, and ends with the weights of a
run never stopped."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_preemption import _losses, _train, preemption_command
from tp_train.errors import CheckpointError
from tp_train.lightning.data_position import PROGRESS, DataPosition
from tp_train.lightning.resumable_loader import SEQUENCES_PER_BATCH, ResumableDistributedSampler
from tp_train.tools.export import export_lightning

# Memory that four ranks' share of the batch (2 sequences each) fits and two ranks' (4 each) does not: on two devices
# the chooser accumulates 2 micro-batches of 2, so the resumed run cuts the epoch into other batches than the saved
# one. FSDP2 is pinned: its shards move from 4 ranks to 2 (and a launching rank that had simulated in its own
# process hung loading them).
MEMORY_GIB = "0.00075"


@pytest.mark.slow
def test_the_same_command_on_two_devices_resumes_a_four_device_checkpoint_and_ends_with_the_unbroken_weights(tmp_path):
    command = [
        "model.config.dropout=0.0" if item.startswith("model.config.dropout=") else item
        for item in preemption_command(
            tmp_path, "parallel=auto", "data_parallel=fsdp", "global_batch_size=8", f"memory_per_device={MEMORY_GIB}"
        )
    ]  # no dropout: another number of ranks draws other masks
    straight = _train(tmp_path, *command, "trainer.devices=4")
    preempted = _train(tmp_path, *command, "trainer.devices=4", signal_at=(6, "SIGTERM"))
    resumed = _train(tmp_path, *command, "trainer.devices=2")
    chosen = [run.stdout.splitlines()[0].split("; chose ")[1] for run in (straight, preempted, resumed)]
    assert chosen == [*["tp=1 pp=1 dp=4 hsdp x2"] * 2, "tp=1 pp=1 dp=2 fsdp accumulate 2"], chosen
    runs = sorted((tmp_path / "runs").iterdir(), key=lambda run: (run / ".hydra" / "config.yaml").stat().st_mtime)
    assert f"resuming from {runs[1] / 'checkpoints' / 'last.ckpt'}" in resumed.stderr  # ckpt_path=auto found it
    losses = [_losses(run) for run in runs]
    assert sorted(losses[1]) == list(range(7)) and sorted(losses[2]) == list(range(7, 12))
    assert losses[1] == pytest.approx({step: losses[0][step] for step in range(7)}, abs=1e-5)
    # The resumed run's final weights are the unbroken run's: its logged losses are not comparable, each being its
    # last micro-batch's (half the step's sequences) where the unbroken run logs the whole step's.
    straight_weights, resumed_weights = (
        _final_weights(run, tmp_path / f"whole{i}.ckpt") for i, run in ((0, runs[0]), (2, runs[2]))
    )
    assert resumed_weights.keys() == straight_weights.keys()
    gap = max((resumed_weights[key] - straight_weights[key]).abs().max().item() for key in straight_weights)
    assert gap < 1e-5, gap


def _final_weights(run: Path, out: Path) -> dict:
    """The run's last checkpoint, whole."""
    return torch.load(export_lightning(run / "checkpoints" / "last.ckpt", out), weights_only=False)["state_dict"]


def test_with_whole_steps_every_layout_trains_the_same_sequences_at_each_step():
    dataset = list(range(30))  # not a whole number of steps of 8: the tail of each epoch's order is left out

    def steps(ranks: int, batch: int) -> list[list[int]]:
        samplers = [ResumableDistributedSampler(dataset, ranks, rank, seed=3, step_size=8) for rank in range(ranks)]
        assert all(len(sampler) == 24 // ranks for sampler in samplers)  # 3 whole steps, not 30 padded for the ranks
        shares = [list(sampler) for sampler in samplers]
        assert all(len(share) == 24 // ranks for share in shares)
        return [sorted(i for share in shares for i in share[k * batch : (k + 1) * batch]) for k in range(3)]

    assert steps(4, 2) == steps(2, 4) == steps(1, 8)
    assert len({i for step in steps(1, 8) for i in step}) == 24


def _resumed(batches: int, saved: int, batch_size: int, ranks: int, accumulation: int) -> dict:
    """A checkpoint's loop and loader state after `DataPosition` read it into a run of this layout."""
    state = {"epoch": 1, SEQUENCES_PER_BATCH: saved, "batches": batches}
    progress = {kind: {"ready": batches, "started": batches, "processed": batches, "completed": batches - 1}
                for kind in ("current", "total")}  # fmt: skip
    checkpoint = {"loops": {"fit_loop": {"state_dict": {"combined_loader": [state]}, PROGRESS: progress}}}
    trainer = SimpleNamespace(
        datamodule=SimpleNamespace(batch_size=batch_size),
        distributed_sampler_kwargs={"num_replicas": ranks, "rank": 0},
        accumulate_grad_batches=accumulation,
    )
    DataPosition().on_load_checkpoint(trainer, None, checkpoint)
    return checkpoint["loops"]["fit_loop"]


def test_a_position_is_counted_in_this_runs_batches_or_refused_in_one_line():
    resumed = _resumed(batches=3, saved=8, batch_size=2, ranks=2, accumulation=2)  # 24 sequences in: 6 batches of 4
    assert resumed["state_dict"]["combined_loader"][0]["batches"] == 6
    assert resumed[PROGRESS]["current"] == {"ready": 6, "started": 6, "processed": 6, "completed": 5}
    assert _resumed(batches=3, saved=8, batch_size=1, ranks=2, accumulation=4)[PROGRESS]["current"]["ready"] == 12
    # the same cut is this run's whatever it accumulates (an epoch's last step may be partial): taken as saved
    assert _resumed(batches=3, saved=8, batch_size=4, ranks=2, accumulation=2)[PROGRESS]["current"]["ready"] == 3
    with pytest.raises(CheckpointError, match=r"^the checkpoint stopped after 24 sequences .* optimizer steps of 16"):
        _resumed(batches=3, saved=8, batch_size=16, ranks=1, accumulation=1)
