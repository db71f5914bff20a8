"""The GPU check's first lines: this machine's versions (python, torch, CUDA, GPU, lightning, transformers and the
rest tp_train uses) and whether its torch meets pyproject.toml's floor, as text and as JSON (to the path given)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import tomllib
import torch
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["lightning", "pytorch-lightning", "transformers", "peft", "accelerate", "triton", "huggingface-hub"]
PACKAGES += ["numpy", "hydra-core", "omegaconf", "datasets", "wandb", "pytest", "pytest-xdist", "pytest-timeout"]


def _driver() -> str:
    query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
    return subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()


def torch_floor() -> str:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (requirement,) = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
    return str(requirement.specifier)


def _asked(question):
    """The answer, or what went wrong asking (a version line must never stop the check)."""
    try:
        return question()
    except Exception as error:  # noqa: BLE001
        return f"unknown ({type(error).__name__}: {error})"


def versions() -> dict:
    cuda = torch.cuda.is_available()
    out = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": _asked(torch.cuda.get_device_name) if cuda else None,
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "capability": _asked(lambda: ".".join(map(str, torch.cuda.get_device_capability()))) if cuda else None,
        "nccl": _asked(lambda: str(torch.cuda.nccl.version())) if cuda else None,
        "driver": _asked(_driver) if cuda else None,
        "cpus": os.cpu_count(),
    }
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None  # not installed (yet: the install phase brings the wheelhouse's)
    floor = torch_floor()
    out["torch_floor"] = floor
    out["torch_meets_floor"] = Version(torch.__version__.split("+")[0]) in Requirement(f"torch{floor}").specifier
    return out


def main() -> None:
    found = versions()
    for name, value in found.items():
        if name not in ("torch_floor", "torch_meets_floor"):
            print(f"{name:>16}: {value}")
    verdict = "meets it" if found["torch_meets_floor"] else "is BELOW it: expect failures"
    print(f"torch {found['torch']}: tp_train needs torch{found['torch_floor']} (pyproject.toml); this torch {verdict}")
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
