"""What a rank holds in memory, measured the same way by training's set-up peak and by the benchmarks: CUDA's
allocator on a GPU; on CPU the process's resident set (VmRSS) and its peak (VmHWM), which writing 5 to
/proc/self/clear_refs starts again from the current resident set."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

CLEAR_REFS = Path("/proc/self/clear_refs")


def return_freed_memory_at_once(device: torch.device, threshold: int = 1 << 20) -> None:
    """On CPU, makes glibc hand every freed block of `threshold` bytes or more back to the system at once (a fixed
    M_MMAP_THRESHOLD), so the resident set follows the live tensors and a step's peak is its own."""
    if device.type == "cpu":
        ctypes.CDLL("libc.so.6").mallopt(-3, threshold)


def measurable(device: torch.device) -> bool:
    """Whether this process can start a new peak on `device` (a CPU peak needs Linux's /proc)."""
    return device.type == "cuda" or CLEAR_REFS.exists()


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak: CUDA's allocator peak, or on CPU the process's peak resident set (VmHWM)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with CLEAR_REFS.open("w") as clear:
        clear.write("5")  # the peak resident set becomes the current one


def peak_memory(device: torch.device) -> int:
    """Bytes at the peak since `reset_peak_memory`: CUDA's allocated peak, or on CPU the peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status_bytes("VmHWM:")


def current_memory(device: torch.device) -> int:
    """Bytes now: CUDA's allocated bytes, or on CPU the resident set (VmRSS)."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _status_bytes("VmRSS:")


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as status:
        return int(next(line for line in status if line.startswith(field)).split()[1]) * 1024
