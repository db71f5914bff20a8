"""The launch's store (`tp_train.lightning.rendezvous`): a restarted torchrun round agrees on a name no earlier round
used, however its ranks arrive, and a rank that never joins is named; rank 0's decision reaches every rank of a job
a cluster started, before any process group exists."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
from torch.distributed import PrefixStore, TCPStore

from tp_train.lightning.rendezvous import JoinError, join_round

ROOT = Path(__file__).resolve().parents[1]


def _round(store: TCPStore, world_size: int, delays: dict[int, float], timeout: float = 30) -> dict[int, object]:
    """Every rank of a round joins from its own thread (rank r after delays[r] s); rank -> token or error."""
    results: dict[int, object] = {}

    def join(rank: int) -> None:
        time.sleep(delays.get(rank, 0.0))
        try:
            results[rank] = join_round(
                PrefixStore("join", _client(store)), rank, world_size, timedelta(seconds=timeout)
            )
        except JoinError as error:
            results[rank] = error

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _client(server: TCPStore) -> TCPStore:
    """A connection of its own, as each rank's process has (a client blocked in `wait` serves no other caller)."""
    return TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)


def test_each_round_agrees_on_a_token_no_earlier_round_used_whoever_comes_first(store):
    tokens = []
    # Rank 0 first (it reads the dead round's hellos before anyone rewrites them), rank 0 last, and at once.
    for delays in ({}, {1: 0.3, 2: 0.3}, {0: 0.3}, {2: 0.5}):
        results = _round(store, 3, delays)
        assert len(set(results.values())) == 1, results  # every rank of the round took the same
        tokens.append(results[0])
    assert len(set(tokens)) == len(tokens), tokens  # and no round reused an earlier one


def test_a_rank_that_never_joins_is_named(store):
    # Ranks 0 and 1 of a world of 3; rank 2 never comes.
    errors: dict[int, object] = {}

    def join(rank: int) -> None:
        try:
            errors[rank] = join_round(PrefixStore("join", _client(store)), rank, 3, timedelta(seconds=1))
        except JoinError as error:
            errors[rank] = error

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert isinstance(errors[0], JoinError)
    assert str(errors[0]) == "rank 2 did not join this launch within 1 s (the collective timeout); stopping"
    assert isinstance(errors[1], str)  # rank 1 was answered; it then fails in its first collective


DECIDE = """
import json, os, sys
import lightning as L
from tp_train import TensorParallelStrategy
trainer = L.Trainer(strategy=TensorParallelStrategy(tensor_parallel_size=2), devices=2, accelerator="cpu",
                    logger=False, enable_progress_bar=False)
decision = trainer.strategy.rank_zero_decides(lambda: {"decided_by": os.getpid()})
print("DECISION " + json.dumps({"pid": os.getpid(), **decision}), flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_rank_zero_decides_for_every_rank_of_a_job_a_cluster_started():
    """Two tasks as SLURM's srun starts them: each would decide differently (its own pid); both take rank 0's."""
    port = _free_port()
    tasks = [
        subprocess.Popen(
            [sys.executable, "-c", DECIDE],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                "SLURM_NTASKS": "2",
                "SLURM_NTASKS_PER_NODE": "2",
                "SLURM_JOB_NUM_NODES": "1",
                "SLURM_NODEID": "0",
                "SLURM_PROCID": str(rank),
                "SLURM_LOCALID": str(rank),
                "SLURM_JOB_ID": "7",
                "SLURM_JOB_NAME": "decide",
                "SLURM_NODELIST": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )  # fmt: skip
        for rank in (0, 1)
    ]
    outputs = [task.communicate(timeout=120) for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0], outputs
    decisions = [json.loads(out.split("DECISION ", 1)[1]) for out, _ in outputs]
    assert decisions[0]["decided_by"] == decisions[0]["pid"]  # rank 0 decided
    assert decisions[1]["decided_by"] == decisions[0]["pid"] != decisions[1]["pid"]  # and rank 1 took it


def test_the_launching_process_holds_the_stores_port_before_any_rank_starts(monkeypatch):
    """Lightning drew a free port and rank 0 bound it only once it had started: in a parallel test run another
    process took it in between (`EADDRINUSE` in rank 0's TCPStore, the spawn launcher)."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from tp_train.lightning import rendezvous

    monkeypatch.delenv("MASTER_PORT", raising=False)
    port = rendezvous.host_store(LightningEnvironment(), timedelta(seconds=30))
    try:
        assert os.environ[rendezvous.HOSTED_PORT] == str(port)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # no other process can take it now
        own, _ = rendezvous.job_store("127.0.0.1", port, 0, 2, timedelta(seconds=30))  # popen: rank 0 launched
        own.set("from rank 0", "1")
        peer, _ = rendezvous.job_store("127.0.0.1", port, 1, 2, timedelta(seconds=30))
        assert peer.get("from rank 0") == b"1"
    finally:
        rendezvous.release_store(port)
    assert rendezvous.HOSTED_PORT not in os.environ


def test_rank_zero_joins_as_a_client_where_its_launcher_hosts_the_store(monkeypatch):
    """A rank 0 the spawn launcher started finds the store already listening, in its launching process."""
    from tp_train.lightning import rendezvous

    launcher = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    launcher.set("hosted by", "the launcher")
    monkeypatch.setenv(rendezvous.HOSTED_PORT, str(launcher.port))
    rank_zero, _ = rendezvous.job_store("127.0.0.1", launcher.port, 0, 2, timedelta(seconds=30))  # no EADDRINUSE
    assert rank_zero.get("hosted by") == b"the launcher"
