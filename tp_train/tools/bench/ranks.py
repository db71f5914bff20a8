"""Starting the benchmark's ranks: one process per rank on this machine, forked, joined into one process group
(NCCL on GPUs, one device per rank; gloo with one intra-op thread per rank on CPU)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def start_ranks(fn: Callable, world_size: int, *args) -> None:
    """Runs `fn(rank, world_size, device, *args)` on `world_size` ranks and returns when all have finished."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.start_processes(_rank, (fn, world_size, port, args), nprocs=world_size, start_method="fork")
    sys.stdout.flush()


def _rank(rank: int, fn: Callable, world_size: int, port: int, args: tuple) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(minutes=10),
    )
    try:
        fn(rank, world_size, device, *args)
    finally:
        dist.destroy_process_group()
