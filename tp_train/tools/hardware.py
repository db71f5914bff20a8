"""Hardware profiles: what the time model (`tp_train.tools.step_time`) prices a simulated step with. One record per
kind of machine, each number with its source: data sheets for the GPUs, a measurement on this kind of machine for
CPU ranks (`python -m tp_train.tools.hardware` measures it again).

The GPUs' `efficiency` is the fraction of the data sheet's dense bf16 FLOP/s that a training step's FLOPs reach. It is
one constant per profile, fitted on one published run: torchtitan's benchmarks/llama3_h100_202412_torchtitan.md,
Table 1 (Llama 3.1 8B, FSDP over 8 H100s, sequence 8192, eager): 5,762 tokens/s per GPU at 6N + 12LHT = 57.9 GFLOP a
token is 0.34 of 989 TFLOP/s. The A100 and H200 take the H100's until a run of their own is fitted.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

GIB = 2**30
FITTED_EFFICIENCY = 0.34  # see the module docstring


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of device and the network between them."""

    name: str
    flops_per_s: float  # one device's: dense bf16 on a GPU (data sheet), fp32 matmuls on one CPU core (measured)
    efficiency: float  # the fraction of `flops_per_s` a step's FLOPs reach
    operation_s: float  # the fixed cost of one dispatched operation (a kernel launch; an op's dispatch on a CPU)
    memory_bytes_per_s: float  # one device's memory bandwidth: what the operations other than matmuls are bound by
    memory_bytes: int  # one device's memory
    devices_per_node: int
    intra_node_bytes_per_s: float  # one device's bandwidth to its node's others, one direction (NVLink; shared memory)
    inter_node_bytes_per_s: float  # one device's bandwidth to other nodes, one direction (its network card)
    latency_s: float  # a collective's cost per step of its algorithm (a hop of a ring)
    overlap: float  # the fraction of the compute that data-parallel collectives can run beside (0: none)
    cores: int | None = None  # CPU ranks: the cores the node's ranks share (their work slows once ranks exceed them)
    thread_efficiency: float = 1.0  # CPU ranks: what each intra-op thread past the first adds, of one thread's rate
    source: str = ""

    def thread_speed(self, ranks_on_node: int) -> float:
        """How many times one thread's rate each rank computes at when `ranks_on_node` share the node: CPU ranks
        split the cores into intra-op threads (`cores // ranks`, at least one, as Lightning's launcher does), each past
        the first adding `thread_efficiency`; a GPU is its rank's own (1). Ranks beyond the cores share them: the time
        model's `sharing`."""
        if self.cores is None:
            return 1.0
        return 1 + (max(1, self.cores // ranks_on_node) - 1) * self.thread_efficiency


# NVIDIA's data sheets: H100 SXM5 and H200 SXM (dense bf16 989 TFLOP/s; NVLink 4 at 900 GB/s both directions), A100
# SXM4 80GB (312 TFLOP/s; NVLink 3 at 600 GB/s); one 400 Gb/s NDR InfiniBand card per GPU (200 Gb/s HDR on A100
# systems), 8 GPUs a node (HGX / DGX). Latency: a few microseconds a hop for NCCL within a node, ~10 across nodes.
GPU_PROFILES = {
    "h100-80gb": HardwareProfile(
        "h100-80gb", 989e12, FITTED_EFFICIENCY, 5e-6, 3.35e12, 80 * 10**9, 8, 450e9, 50e9, 10e-6, 0.9,
        source="NVIDIA H100 SXM5 data sheet; efficiency fitted on torchtitan's Llama 3.1 8B FSDP run",
    ),
    "h200-141gb": HardwareProfile(
        "h200-141gb", 989e12, FITTED_EFFICIENCY, 5e-6, 4.8e12, 141 * 10**9, 8, 450e9, 50e9, 10e-6, 0.9,
        source="NVIDIA H200 SXM data sheet; the H100's efficiency",
    ),
    "a100-80gb": HardwareProfile(
        "a100-80gb", 312e12, FITTED_EFFICIENCY, 5e-6, 2.039e12, 80 * 10**9, 8, 300e9, 25e9, 10e-6, 0.9,
        source="NVIDIA A100 SXM4 80GB data sheet; the H100's efficiency",
    ),
}  # fmt: skip
# This project's CI machine (2 cores, 24 GiB, gloo over loopback), 2026-12-07: one thread's fp32 matmul rate and an
# op's dispatch measured by `python -m tp_train.tools.hardware`; one thread's copy bandwidth on 32 MiB tensors (16-27
# GB/s); gloo's all-reduce latency a hop and bandwidth from 2 ranks' all-reduces of 4 B to 16 MiB. `efficiency` and
# `thread_efficiency` fitted (the worst predicted / measured ratio made smallest, on a grid) on the 49 measured steps
# of `python -m tp_train.tools.bench.step_time`: three runs of its 9 layouts and two of its choice sweep
# (docs/choosing-degrees.md).
CPU_HERE = HardwareProfile(
    "cpu-2core", 7.0e10, 1.0, 9e-6, 2.0e10, 24 * GIB, 64, 0.8e9, 0.8e9, 2.5e-4, 0.0, cores=2, thread_efficiency=0.3,
    source="measured on this project's 2-core CI machine, 2026-12-07",
)  # fmt: skip
PROFILES = {**GPU_PROFILES, CPU_HERE.name: CPU_HERE}


def profile_named(name: str) -> HardwareProfile:
    if name not in PROFILES:
        raise ValueError(f"hardware={name!r} is not a known profile; use one of {', '.join(PROFILES)}")
    return PROFILES[name]


def matmul_flops_per_s(size: int = 512, seconds: float = 1.0) -> float:
    """One thread's fp32 matrix-product rate at `size` x `size` x `size`."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        runs, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            a @ b
            runs += 1
        return 2 * size**3 * runs / (time.perf_counter() - start)
    finally:
        torch.set_num_threads(previous)


def operation_s(seconds: float = 0.5) -> float:
    """The cost of dispatching one small operation on this CPU (a tiny add, its arithmetic negligible)."""
    x = torch.ones(8)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        x.add(1.0)
        runs += 1
    return (time.perf_counter() - start) / runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tp_train.tools.hardware", description="Measure this CPU's profile (compute and dispatch)."
    )
    parser.parse_args(argv)
    print(json.dumps({"flops_per_s": matmul_flops_per_s(), "operation_s": operation_s(), "known": list(PROFILES)}))
    print(json.dumps(asdict(CPU_HERE)))


if __name__ == "__main__":
    main()
