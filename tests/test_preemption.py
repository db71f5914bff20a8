"""Preemption and auto-resume: a real SIGTERM/SIGUSR1 saves a checkpoint after the current step on every rank and
exits 0; the same command again resumes from it, mid-epoch, with the losses of a run that was never interrupted."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from tests import train_cases
from tests.distributed import run_on_ranks
from tests.lightning_helpers import LitLM, loader, make_trainer
from tests.signal_at_step import SignalAtStep
from tp_train import TextDataModule
from tp_train.app import resume
from tp_train.errors import ConfigError
from tp_train.lightning.preemption import Preempted, PreemptionCheckpoint
from tp_train.lightning.resumable_loader import ResumableDataLoader, ResumableDistributedSampler

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the parrot is resting not dead it has ceased to be bereft of life it rests in peace a stiff".split()


def refusal(tmp_path, *overrides: str) -> tuple[str, subprocess.CompletedProcess]:
    """Runs `train.py experiment=smoke logger=none *overrides`, asserts it was refused (status 2, no traceback, one
    `error: ` line) and returns that line and the process."""
    result = train_cases.run(
        [sys.executable, "train.py", "experiment=smoke", "logger=none", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=ROOT, env={**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    return errors[0], result


def _epochs(loader_factory, epochs: int) -> list[list[int]]:
    batches = []
    for epoch in range(epochs):
        dataloader = loader_factory()
        dataloader.sampler.set_epoch(epoch)
        batches += [batch.tolist() for batch in dataloader]
    return batches


@pytest.mark.parametrize("rank", [0, 1])
def test_loader_resumes_at_the_next_untrained_batch_of_its_epoch(rank):
    data = torch.arange(23)  # 12 samples per rank at dp=2 (one padded), batches of 5: 3 per epoch, the last short

    def build() -> ResumableDataLoader:
        return ResumableDataLoader(data, 5, ResumableDistributedSampler(data, num_replicas=2, rank=rank, seed=3))

    straight = _epochs(build, 3)
    assert len(straight) == 9 and straight[:3] != straight[3:6]  # a new order each epoch
    for stop in range(1, 9):  # every position, epoch boundaries included
        first, epoch = build(), 0
        seen = []
        while len(seen) < stop:
            first.sampler.set_epoch(epoch)
            for batch in first:
                seen.append(batch.tolist())
                if len(seen) == stop:
                    break
            epoch += 1
        state = first.state_dict()
        assert state == {"epoch": (stop - 1) // 3, "batches": (stop - 1) % 3 + 1, "sequences_per_batch": 10}
        resumed = build()
        resumed.load_state_dict(state)
        for epoch in range(state["epoch"], 3):  # as Lightning does: the saved epoch again, then the next ones
            resumed.sampler.set_epoch(epoch)
            seen += [batch.tolist() for batch in resumed]
        assert seen == straight, stop


class _BatchRecorder(L.LightningModule):
    """Trains on integer samples and records them; the DataLoader class is the one under test."""

    def __init__(self, loader_class: type):
        super().__init__()
        self.layer, self.loader_class, self.seen = torch.nn.Linear(1, 1), loader_class, []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch.tolist())
        return self.layer(batch.float()[:, None]).square().mean()

    def train_dataloader(self):
        data = torch.arange(16)  # batches of 3: 6 per epoch
        if self.loader_class is ResumableDataLoader:
            return ResumableDataLoader(data, 3, ResumableDistributedSampler(data, seed=5))
        return torch.utils.data.DataLoader(data, 3, shuffle=True, generator=torch.Generator().manual_seed(5))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(module, root: Path, max_steps: int, callbacks=(), ckpt_path=None) -> None:
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, default_root_dir=root, callbacks=list(callbacks),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, ckpt_path=ckpt_path)


@pytest.mark.parametrize("loader_class", [ResumableDataLoader, torch.utils.data.DataLoader])
def test_a_preempted_fit_resumes_the_train_loader_mid_epoch(tmp_path, loader_class):
    straight = _BatchRecorder(loader_class)
    _fit(straight, tmp_path / "straight", 14)
    first = _BatchRecorder(loader_class)
    with pytest.raises(Preempted) as stop:  # signalled after step 7, seen after step 8: batch 2 of epoch 1
        _fit(first, tmp_path / "run", 14, [PreemptionCheckpoint(), SignalAtStep(7, signal.SIGTERM)])
    assert stop.value.step == 8 and stop.value.code == 0
    assert stop.value.checkpoint == tmp_path / "run" / "checkpoints" / "last.ckpt"
    resumed = _BatchRecorder(loader_class)
    _fit(resumed, tmp_path / "run", 14, ckpt_path=stop.value.checkpoint)
    assert len(first.seen) == 8 and len(resumed.seen) == 6
    if loader_class is ResumableDataLoader:
        assert first.seen + resumed.seen == straight.seen
    else:  # the negative control: a plain DataLoader starts the epoch over
        assert first.seen + resumed.seen != straight.seen


def _signal_one_rank(rank, world_size, root):
    torch.manual_seed(0)
    # Only rank 1 is signalled (SLURM's SIGUSR1), after step 3; rank 0 learns it from the agreement all-reduce.
    callbacks = [PreemptionCheckpoint(), SignalAtStep(3, signal.SIGUSR1, rank=1)]
    trainer = make_trainer(2, callbacks, max_steps=10, default_root_dir=root)
    try:
        trainer.fit(LitLM(), loader(2, 10))
    except Preempted as stop:
        return stop.step, str(stop.checkpoint), str(stop)
    return trainer.global_step, None, None


@pytest.mark.slow
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_step(tmp_path):
    results = run_on_ranks(_signal_one_rank, 2, str(tmp_path), timeout=240)
    checkpoint = tmp_path / "checkpoints" / "last.ckpt"
    assert [r[:2] for r in results] == [(4, str(checkpoint))] * 2
    assert results[0][2].startswith(f"SIGUSR1: stopped after step 4, checkpoint saved to {checkpoint}")
    assert (checkpoint / ".metadata").is_file()


# ------------------------------------------------------------------------------------------ auto-resume rule


def _run_dir(root: Path, name: str, overrides: list[str], saved: float | None = None, finished: float | None = None):
    run = root / name
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if saved is not None:
        checkpoint = run / "checkpoints" / "last.ckpt"
        checkpoint.mkdir(parents=True)
        for name in (".metadata", "meta.pt"):
            (checkpoint / name).write_text("")
            os.utime(checkpoint / name, (saved, saved))
    if finished is not None:
        (run / "summary.json").write_text("{}")
        os.utime(run / "summary.json", (finished, finished))
    return run


def test_auto_resume_takes_the_last_checkpoint_of_the_same_command_unless_it_finished(tmp_path, monkeypatch):
    monkeypatch.delenv(resume.ENVIRONMENT_VARIABLE, raising=False)
    now, command = time.time(), ["tp=2", "precision=32"]
    template = f"{tmp_path}/${{now:%Y-%m-%d}}/${{now:%H-%M-%S}}"
    current = _run_dir(tmp_path, "day/3", command)

    def auto(overrides=command, ckpt_path="auto"):
        return resume.resolve(ckpt_path, template, current, overrides)

    assert auto() is None  # no earlier run
    preempted = _run_dir(tmp_path, "day/1", ["precision=32", "tp=2", "ckpt_path=auto"], saved=now - 50)
    _run_dir(tmp_path, "day/0", ["tp=4"], saved=now - 10)  # another command
    _run_dir(tmp_path, "day/2", command)  # resumed, killed before it saved anything
    assert auto() == str(preempted / "checkpoints" / "last.ckpt")  # order of overrides and ckpt_path aside
    assert auto(ckpt_path=None) is None and auto(ckpt_path="/some/ckpt") == "/some/ckpt"
    assert auto(overrides=["tp=2"]) is None
    _run_dir(tmp_path, "day/4", command, saved=now - 20, finished=now - 19)  # resumed and finished
    assert auto() is None
    monkeypatch.setenv(resume.ENVIRONMENT_VARIABLE, "/from/the/launcher")  # a child rank
    assert auto() == "/from/the/launcher"


def test_under_parallel_auto_the_same_command_on_another_number_of_devices_is_the_same_run(tmp_path, monkeypatch):
    monkeypatch.delenv(resume.ENVIRONMENT_VARIABLE, raising=False)
    template = f"{tmp_path}/${{now:%H-%M-%S}}"
    command = ["parallel=auto", "global_batch_size=8"]
    current = _run_dir(tmp_path, "2", [*command, "trainer.devices=2"])
    at_four = _run_dir(tmp_path, "1", [*command, "trainer.devices=4", "trainer.num_nodes=1"], saved=time.time() - 5)
    resumed = resume.resolve("auto", template, current, [*command, "trainer.devices=2"], elastic=True)
    assert resumed == str(at_four / "checkpoints" / "last.ckpt")
    assert resume.resolve("auto", template, current, [*command, "trainer.devices=2"]) is None  # degrees given
    other = resume.resolve("auto", template, current, ["parallel=auto", "global_batch_size=4"], elastic=True)
    assert other is None  # another global batch is another run


# -------------------------------------------------------------------------------------------- through train.py


def _corpus(path: Path, lines: int) -> Path:
    generator = torch.Generator().manual_seed(0)
    text = [" ".join(WORDS[i] for i in torch.randint(len(WORDS), (12,), generator=generator)) for _ in range(lines)]
    path.write_text(".\n".join(text))
    return path


def _train(tmp_path: Path, *command: str, signal_at: tuple[int, str] | None = None) -> subprocess.CompletedProcess:
    prefix = ["tests/signal_at_step.py", str(signal_at[0]), signal_at[1]] if signal_at else ["train.py"]
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache"), "HYDRA_FULL_ERROR": "1"}
    env.pop(resume.ENVIRONMENT_VARIABLE, None)
    result = train_cases.run([sys.executable, *prefix, *command], cwd=ROOT, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


def _losses(run_dir: Path) -> dict[int, tuple[int, float]]:
    """step -> (epoch, train loss) from the run's CSV log."""
    (metrics,) = run_dir.glob("csv/*/metrics.csv")
    rows = [row for row in csv.DictReader(metrics.open()) if row.get("train/loss")]
    return {int(row["step"]): (int(row["epoch"]), float(row["train/loss"])) for row in rows}


def preemption_command(tmp_path: Path, *overrides: str) -> list[str]:
    """train.py's overrides for 12 steps of a one-layer GPT with dropout on a small corpus, CSV-logged every step,
    a new run directory per run; `overrides` (tp, precision) come first."""
    corpus = _corpus(tmp_path / "corpus.txt", 40)
    return [
        *overrides, "data=local_text", f"data.source={corpus}", "data.block_size=32", "data.batch_size=4",
        "data.vocab_size=300", "data.val_fraction=0.1", "model.config.n_layer=1", "model.config.n_head=2",
        "model.config.n_embd=32", "model.config.dropout=0.1", "trainer.max_steps=12", "trainer.val_check_interval=100",
        "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
        "~callbacks.progress_bar", "scheduler=constant", "logger=csv",
        f"hydra.run.dir={tmp_path}/runs/${{now:%H-%M-%S-%f}}",  # the default layout's kind: a new dir per run
    ]  # fmt: skip


def straight_preempted_resumed(tmp_path: Path, command: list[str]) -> tuple[list, list[Path]]:
    """Runs `command` uninterrupted, then again with SIGTERM after step 6, then again (which resumes); returns the
    three processes and their run directories, in that order."""
    straight = _train(tmp_path, *command)  # uninterrupted; it finishes, so the same command next starts fresh
    preempted = _train(tmp_path, *command, signal_at=(6, "SIGTERM"))  # SIGTERM to the launching process
    resumed = _train(tmp_path, *command)
    by_start = sorted((tmp_path / "runs").iterdir(), key=lambda run: (run / ".hydra" / "config.yaml").stat().st_mtime)
    return [straight, preempted, resumed], by_start


def assert_resumed_with_the_same_losses(run_dirs: list[Path], tolerance: float = 1e-5) -> None:
    """The preempted run logged steps 0-6, the resumed one 7-11 (mid-epoch, past the first), each with the loss the
    uninterrupted run logged at that step."""
    straight, first, second = (_losses(d) for d in run_dirs)
    assert (
        sorted(straight) == list(range(12)) and sorted(first) == list(range(7)) and sorted(second) == list(range(7, 12))
    )
    epoch_of_step_7 = straight[7][0]
    assert epoch_of_step_7 >= 1 and straight[6][0] == epoch_of_step_7  # resumed mid-epoch, past the first epoch
    for step in range(12):
        loss = (first if step < 7 else second)[step][1]
        assert abs(loss - straight[step][1]) <= tolerance, (step, loss, straight[step][1])
    print({step: (straight[step][1], (first if step < 7 else second)[step][1]) for step in range(12)})


@pytest.mark.slow
def test_sigterm_mid_epoch_then_the_same_command_resumes_with_the_same_losses(tmp_path):
    command = preemption_command(tmp_path, "tp=2", "precision=32")
    (_, preempted, resumed), run_dirs = straight_preempted_resumed(tmp_path, command)
    straight_dir, preempted_dir, resumed_dir = run_dirs

    checkpoint = preempted_dir / "checkpoints" / "last.ckpt"
    lines = [line for line in preempted.stderr.splitlines() if "checkpoint saved" in line]
    assert lines == [
        f"SIGTERM: stopped after step 7, checkpoint saved to {checkpoint}; rerun the same command to resume"
    ]
    assert not (preempted_dir / "summary.json").exists()
    assert f"resuming from {checkpoint}" in resumed.stderr

    assert_resumed_with_the_same_losses(run_dirs)

    # The same checkpoint into another model (wider): one line from rank 0 naming it and the mismatch, status 2.
    before = {f.name: f.read_bytes() for f in checkpoint.iterdir()}
    env = {**os.environ, "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    env.pop(resume.ENVIRONMENT_VARIABLE, None)
    other = [*command[:-1], "model.config.n_embd=64", f"ckpt_path={checkpoint}", f"hydra.run.dir={tmp_path}/other"]
    refused = train_cases.run([sys.executable, "train.py", *other], cwd=ROOT, env=env, timeout=600)
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error: ")]
    assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr[-3000:]
    assert len(errors) == 1 and str(checkpoint) in errors[0] and "[300, 32] there but" in errors[0], errors
    assert {f.name: f.read_bytes() for f in checkpoint.iterdir()} == before  # nothing overwritten


# ---------------------------------------------------------------------------------------------- data errors


def _empty_files(directory: Path) -> Path:
    for name in ("a.txt", "b.txt"):
        (directory / name).write_text("")
    return directory


def test_a_directory_without_text_files_is_a_config_error(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ConfigError) as info:
        TextDataModule(source=str(tmp_path), cache_dir=str(tmp_path / "cache")).prepare_data()
    assert str(info.value) == (
        f"data.source='{tmp_path}' is a directory without .txt/.md/.py/.json/.jsonl files; point it at text files "
        f"(a file, a directory or a glob) or use data.source=python_stdlib"
    )


DATA_ERRORS = {  # through train.py, where the launching process prepares the data
    "empty_files": (_empty_files, "is empty: its files hold 0 tokens"),
    "smaller_than_a_block": (lambda directory: _corpus(directory / "small.txt", 2), "fewer than the 2 blocks"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DATA_ERRORS))
def test_unusable_corpus_is_one_line_exit_2_before_any_rank_starts(case, tmp_path):
    make, expected = DATA_ERRORS[case]
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    source = make(corpus)
    error, result = refusal(tmp_path, "data=local_text", f"data.source={source}", "data.vocab_size=300")
    assert f"data.source='{source}'" in error and expected in error, error
    assert "Starting with 2 processes" not in result.stderr + result.stdout  # refused before the ranks started
