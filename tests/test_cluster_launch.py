"""train.py as clusters run it, with real launchers and real kills: torchrun restarting after a worker is SIGKILLed,
two torchrun agents as two nodes, SLURM's srun environment with a preemption signal and a requeue, and a job
SIGKILLed in the middle of a checkpoint save. Each ends by itself with the final losses of one uninterrupted run."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import train_cases
from tp_train.checkpoint.safe_load import read_extra

ROOT = Path(__file__).resolve().parents[1]
# A checkpoint every 10 steps (callbacks.checkpoint follows val_check_interval).
COMMAND = ["experiment=smoke", "tp=2", "logger=none", "data.max_files=20", "trainer.max_steps=40",
           "trainer.val_check_interval=10", "trainer.limit_val_batches=1", "trainer.enable_progress_bar=false",
           "~callbacks.progress_bar"]  # fmt: skip
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TIMEOUT = 300


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")  # the data is prepared once, by the first run


@pytest.fixture(scope="module")
def uninterrupted(cache, tmp_path_factory) -> dict:
    """The summary of the same training run straight through, by `python train.py` (its own launcher)."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    result = train_cases.run([sys.executable, "train.py", *COMMAND, f"hydra.run.dir={run_dir}"], **_run(cache))
    assert result.returncode == 0, result.stderr[-3000:]
    return _summary(run_dir)


def _env(cache: Path, **extra: str) -> dict:
    env = {**os.environ, "TP_TRAIN_CACHE": str(cache), "OMP_NUM_THREADS": "1", **extra}
    env.pop("TP_TRAIN_RESUME_FROM", None)
    return env


def _run(cache: Path) -> dict:
    """tests.train_cases.run's arguments."""
    return dict(cwd=ROOT, env=_env(cache), timeout=TIMEOUT)


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _same_run(summary: dict, uninterrupted: dict) -> None:
    assert summary["steps"] == uninterrupted["steps"] == 40
    assert abs(summary["train_loss"] - uninterrupted["train_loss"]) <= 1e-5, (summary, uninterrupted)
    assert abs(summary["val_loss"] - uninterrupted["val_loss"]) <= 1e-5, (summary, uninterrupted)


def _wait_for(path: Path, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + TIMEOUT
    while not path.exists():
        assert process.poll() is None, f"the job ended (status {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {TIMEOUT} s"
        time.sleep(0.05)


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_torchrun_restarts_after_a_killed_worker_and_finishes_with_the_uninterrupted_losses(
    cache, uninterrupted, tmp_path
):
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "train.py", *COMMAND,
               f"hydra.run.dir={run_dir}"]  # fmt: skip
    with open(log, "w") as output:
        torchrun = subprocess.Popen(command, cwd=ROOT, env=_env(cache), stdout=output, stderr=subprocess.STDOUT)
        try:
            _wait_for(run_dir / "checkpoints" / "last.ckpt" / ".metadata", torchrun)
            os.kill(_children(torchrun.pid)[-1], signal.SIGKILL)  # one worker, after the first checkpoint
            assert torchrun.wait(timeout=TIMEOUT) == 0, log.read_text()[-4000:]
        finally:
            torchrun.kill()
    text = log.read_text()
    # torchrun reports the SIGKILL, or, when rank 0's collective failed and it exited before torchrun's next look,
    # rank 0's failure naming the lost peer (seen in 1 of 4 full runs): either way the kill ended the round.
    killed = "exitcode  : -9" in text or "exitcode: -9" in text
    lost_peer = re.search(r"error: rank 0 \(pid \d+\) failed: RuntimeError: .*Connection (reset|closed) by peer", text)
    assert killed or lost_peer, text[-4000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in text, text[-4000:]  # and restarted
    _same_run(_summary(run_dir), uninterrupted)


@pytest.mark.slow
def test_torchrun_restarts_after_a_hung_worker_and_finishes_with_the_uninterrupted_losses(
    cache, uninterrupted, tmp_path
):
    """A worker stopped (SIGSTOP) after the first checkpoint: the hang detector (its limit shortened here) ends the
    round, torchrun restarts it, and `ckpt_path=auto` resumes."""
    run_dir, log = tmp_path / "run", tmp_path / "torchrun.log"
    command = [*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "train.py", *COMMAND,
               "hang_timeout_s=10", f"hydra.run.dir={run_dir}"]  # fmt: skip
    with open(log, "w") as output:
        torchrun = subprocess.Popen(command, cwd=ROOT, env=_env(cache), stdout=output, stderr=subprocess.STDOUT)
        stopped = None
        try:
            _wait_for(run_dir / "checkpoints" / "last.ckpt" / ".metadata", torchrun)
            stopped = _children(torchrun.pid)[-1]
            os.kill(stopped, signal.SIGSTOP)  # one worker hangs, after the first checkpoint (rank 0 may be in it)
            assert torchrun.wait(timeout=TIMEOUT) == 0, log.read_text()[-4000:]
        finally:
            torchrun.kill()
            if stopped is not None and torchrun.returncode != 0:  # a killed agent leaves its stopped worker behind
                try:
                    os.kill(stopped, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    text = log.read_text()
    assert "error: hang: rank 1 stopped responding" in text, text[-4000:]
    assert (run_dir / "hang" / "rank0-stacks.txt").is_file()
    assert "resuming from " in text, text[-4000:]  # the restarted round
    _same_run(_summary(run_dir), uninterrupted)


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_give_one_nodes_losses(cache, uninterrupted, tmp_path):
    run_dir, endpoint = tmp_path / "run", f"127.0.0.1:{_free_port()}"
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                  "--rdzv-id", "two-nodes"]  # fmt: skip
    train = ["train.py", *COMMAND, "trainer.num_nodes=2", "trainer.devices=1", f"hydra.run.dir={run_dir}"]
    output = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agents = [
        subprocess.Popen(
            [*TORCHRUN, *rendezvous, "--node-rank", str(node), *train], cwd=ROOT, env=_env(cache), **output
        )
        for node in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=TIMEOUT)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    _same_run(_summary(run_dir), uninterrupted)


def _srun_environment(rank: int, port: int) -> dict:
    """What `srun --ntasks-per-node 2` sets for task `rank` of a one-node job (Lightning's SLURMEnvironment reads
    these), with the rendezvous port a requeued job keeps."""
    return dict(
        SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank),
        SLURM_LOCALID=str(rank), SLURM_JOB_ID="4242", SLURM_JOB_NAME="tp-train", SLURM_NODELIST="127.0.0.1",
        MASTER_PORT=str(port),
    )  # fmt: skip


@pytest.mark.slow
def test_slurm_preemption_saves_and_the_requeued_job_resumes_with_the_uninterrupted_losses(
    cache, uninterrupted, tmp_path
):
    run_dir, port = tmp_path / "run", _free_port()

    def srun() -> list[subprocess.Popen]:
        command = [sys.executable, "train.py", *COMMAND, f"hydra.run.dir={run_dir}"]
        output = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return [
            subprocess.Popen(command, cwd=ROOT, env=_env(cache, **_srun_environment(rank, port)), **output)
            for rank in (0, 1)
        ]

    tasks = srun()
    try:
        _wait_for(run_dir / "checkpoints" / "last.ckpt" / ".metadata", tasks[0])
        for task in tasks:  # SLURM's --signal=USR1@T signals every task
            task.send_signal(signal.SIGUSR1)
        outputs = [task.communicate(timeout=TIMEOUT)[0] for task in tasks]
    finally:
        for task in tasks:
            task.kill()
    assert [task.returncode for task in tasks] == [0, 0], outputs[0][-3000:]
    assert "SIGUSR1: stopped after step" in outputs[0] and not (run_dir / "summary.json").exists(), outputs[0][-3000:]

    requeued = srun()  # the same job again: same command, job id and directory
    try:
        outputs = [task.communicate(timeout=TIMEOUT)[0] for task in requeued]
    finally:
        for task in requeued:
            task.kill()
    assert [task.returncode for task in requeued] == [0, 0], outputs[0][-3000:]
    assert f"resuming from {run_dir / 'checkpoints' / 'last.ckpt'}" in outputs[0], outputs[0][-3000:]
    _same_run(_summary(run_dir), uninterrupted)


@pytest.mark.slow
def test_a_job_killed_in_the_middle_of_a_save_resumes_from_the_previous_checkpoint_exactly(
    cache, uninterrupted, tmp_path
):
    run_dir, marker = tmp_path / "run", tmp_path / "in-save"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    job = subprocess.Popen(
        [sys.executable, "tests/stall_in_save.py", str(marker), *COMMAND, f"hydra.run.dir={run_dir}"],
        cwd=ROOT, env=_env(cache), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(marker, job)  # the second last.ckpt's shards are written; it is not yet complete
        os.killpg(job.pid, signal.SIGKILL)  # every rank, in the middle of the save
        job.wait(timeout=TIMEOUT)
    finally:
        job.kill()
    (interrupted,) = checkpoint.parent.glob("*.ckpt.tmp")
    assert (interrupted / ".metadata").is_file()  # the interrupted save's shards
    (previous,) = (path for path in checkpoint.parent.glob("step000010.ckpt") if (path / ".metadata").is_file())
    assert read_extra(previous / "meta.pt")["global_step"] == 10  # the previous checkpoint, whole

    result = train_cases.run([sys.executable, "train.py", *COMMAND, f"hydra.run.dir={run_dir}"], **_run(cache))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"resuming from {previous}" in result.stderr  # last.ckpt named the interrupted save: not taken
    _same_run(_summary(run_dir), uninterrupted)
