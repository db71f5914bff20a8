"""The key-value store all ranks of one launch share, before and under their process group."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.environments import ClusterEnvironment
from torch.distributed import PrefixStore, Store, TCPStore

from tp_train.lightning import watchdog

PREFIX = "tp_train"
POLL_SECONDS = 0.05
HOSTED_PORT = "TP_TRAIN_HOSTED_STORE_PORT"  # in the ranks' environment: the launching process hosts the store there

_hosted: dict[int, TCPStore] = {}  # the stores this process hosts for the ranks it launched, by port


class JoinError(RuntimeError):
    """A rank did not join the launch's round in time."""


def job_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta) -> tuple[Store, str]:
    """The store this launch's ranks share, and the scope (a key prefix) of this round in it: under torchrun the
    agent's, scoped to this round (`join_round`); otherwise one rank 0 hosts at `address:port`, as
    `init_process_group` would create it (scope "")."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":  # torchrun: its agent keeps the store over restarts
        store = TCPStore(address, port, world_size, is_master=False, timeout=timeout)
        token = join_round(PrefixStore(f"{PREFIX}/join", store), rank, world_size, timeout)
        scope = f"{PREFIX}/round/{token}"
        return PrefixStore(scope, store), scope
    if port in _hosted:  # this process launched the ranks and is rank 0 (the popen launcher)
        return _hosted[port], ""
    is_master = rank == 0 and os.environ.get(HOSTED_PORT) != str(port)
    return TCPStore(address, port, world_size, is_master=is_master, timeout=timeout, multi_tenant=True), ""


def host_store(environment: ClusterEnvironment, timeout: timedelta) -> int:
    """Binds the launch's store in the launching process before any rank starts, and names its port in the ranks'
    environment: a port drawn free, and bound only once rank 0 had started, could be taken in between (seen in a
    parallel test run: `EADDRINUSE` in rank 0's TCPStore). Returns the port."""
    port = environment.main_port  # the user's MASTER_PORT, or one drawn free now and kept by the environment
    if port not in _hosted:
        _hosted[port] = TCPStore(environment.main_address, port, is_master=True, wait_for_workers=False,
                                 timeout=timeout, multi_tenant=True)  # fmt: skip
    os.environ[HOSTED_PORT] = str(port)
    return port


def release_store(port: int) -> None:
    """Stops hosting the store on `port` (the spawn launcher, once its ranks ended)."""
    _hosted.pop(port, None)
    if os.environ.get(HOSTED_PORT) == str(port):
        del os.environ[HOSTED_PORT]


def join_round(store: Store, rank: int, world_size: int, timeout: timedelta) -> str:
    """The token naming this round, agreed with rank 0 through keys no earlier round wrote (module docstring)."""
    deadline = time.monotonic() + timeout.total_seconds()
    if rank != 0:
        nonce = uuid.uuid4().hex
        store.set(f"hello/{rank}", nonce)
        reply = f"reply/{rank}/{nonce}"
        try:
            store.wait([reply], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
        except Exception as error:  # noqa: BLE001 - the store's timeout (DistStoreError) or a lost agent
            raise JoinError(
                f"rank {rank}: rank 0 did not answer within {timeout.total_seconds():.0f} s of joining this launch "
                f"({type(error).__name__})"
            ) from None
        token = store.get(reply).decode()
        store.set(f"ack/{token}/{rank}", "1")
        return token
    token = uuid.uuid4().hex
    answered: dict[int, bytes] = {}
    pending = set(range(1, world_size))
    while pending:
        for peer in sorted(pending):
            hello = f"hello/{peer}"
            if store.check([hello]) and answered.get(peer) != (nonce := store.get(hello)):
                store.set(f"reply/{peer}/{nonce.decode()}", token)
                answered[peer] = nonce
            if peer in answered and store.check([f"ack/{token}/{peer}"]):
                pending.discard(peer)
        if pending and time.monotonic() > deadline:
            raise JoinError(
                f"rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, sorted(pending)))} did not join this "
                f"launch within {timeout.total_seconds():.0f} s (the collective timeout); stopping"
            )
        if pending:
            time.sleep(POLL_SECONDS)
    return token


class Rendezvous:
    """One process's side of its launch: the store its ranks share (`job_store`, made once, on first use) and the
    decisions rank 0 takes for all of them.

    Args:
        environment: Lightning's cluster environment of this process (torchrun's, SLURM's, the popen launcher's).
        timeout: how long a rank waits for the others (the collective timeout).
    """

    def __init__(self, environment: ClusterEnvironment, timeout: timedelta) -> None:
        self.environment, self.timeout = environment, timeout
        self._store: Store | None = None
        self._scope = ""
        self._decisions = 0

    @property
    def store(self) -> Store:
        if self._store is None:
            env = self.environment
            self._store, self._scope = job_store(
                env.main_address, env.main_port, env.global_rank(), env.world_size(), self.timeout
            )
        return self._store

    def connect(self, timeout: timedelta) -> Store:
        """A connection of its own to this launch's store, in this round's scope, whose calls give up after
        `timeout`: for a background thread (the hang detector's heartbeat) that must neither queue behind the main
        thread's calls nor wait the collective timeout on a store whose host stopped."""
        self.store  # noqa: B018 - joins this round first, which names the scope
        env = self.environment
        client = TCPStore(env.main_address, env.main_port, is_master=False, timeout=timeout)
        return PrefixStore(self._scope, client) if self._scope else client

    def rank_zero_decides(self, decide: Callable[[], Any]) -> Any:
        """`decide()` run on global rank 0 only, its result (a JSON value) returned on every rank of a job a cluster
        started (torchrun, SLURM's srun), through the store, before any process group exists. Elsewhere (the
        launching process of the popen launcher before its ranks start, whose children inherit what it decided
        through their environment, or a single process) it is this process's own decision."""
        env = self.environment
        started_by_cluster = env.creates_processes_externally and watchdog.LAUNCHER_PID not in os.environ
        if not started_by_cluster or env.world_size() == 1:
            return decide()
        key = f"decision/{self._decisions}"
        self._decisions += 1
        if env.global_rank() != 0:
            found = json.loads(self.store.get(key))
            if "failed" in found:
                raise RuntimeError(f"rank 0 failed while deciding for every rank: {found['failed']}")
            return found["value"]
        try:
            value = decide()
        except Exception as error:
            self.store.set(key, json.dumps({"failed": f"{type(error).__name__}: {error}"}))
            raise
        self.store.set(key, json.dumps({"value": value}))
        return value
