"""The GPU check's parts that run without a GPU (docs/performance.md, "GPU check"): the wheelhouse check finds the
wheelhouse complete and names what a missing wheel leaves unresolved; `scripts/gpu_check.sh` without a CUDA device
says so in one line, with exit 0 only when the wheelhouse is complete; the one-device measurement writes its JSON;
the summary reads what the phases left.

The wheelhouse here is made of stand-in wheels: each holds only the METADATA of the distribution this environment has
installed (same name, version and requirements), so the check's walk is exercised offline. `make gpu-wheels` builds
the real one; when it is there, it is checked too."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import train_cases

ROOT = Path(__file__).resolve().parents[1]


def _scripts_module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_wheels = _scripts_module("gpu_wheels")


def _stand_in(wheelhouse: Path, name: str) -> None:
    """A wheel of `name` holding this environment's METADATA of it, installable anywhere (py3-none-any)."""
    distribution = importlib.metadata.distribution(name)
    stem = f"{distribution.metadata['Name'].replace('-', '_')}-{distribution.version}"
    with zipfile.ZipFile(wheelhouse / f"{stem}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", distribution.read_text("METADATA"))


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """Stand-ins of what the walk finds missing from the image, until nothing is: what `download` fetches."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    image = gpu_wheels.image_packages()
    while missing := gpu_wheels.walk(folder, image)[1]:
        for name in missing:
            _stand_in(folder, name)
    return folder


def test_the_wheelhouse_holds_what_the_image_lacks_and_nothing_else(wheelhouse):
    names = {gpu_wheels.canonicalize_name(p.name.split("-")[0]) for p in wheelhouse.glob("*.whl")}
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets", "dill", "wandb", "pydantic"} <= names
    assert not names & {"torch", "lightning", "transformers", "peft", "numpy", "pytest"}  # the image's own
    assert gpu_wheels.problems(wheelhouse) == []


def test_a_removed_wheel_is_named_with_what_needs_it(wheelhouse, tmp_path):
    partial = tmp_path / "wheelhouse"
    shutil.copytree(wheelhouse, partial)
    (removed,) = partial.glob("omegaconf-*.whl")
    removed.unlink()
    found = gpu_wheels.problems(partial)
    assert f"omegaconf: needed by hydra-core, neither in the image nor in {partial}" in found, found
    assert any(line.startswith("omegaconf: imported by tp_train/") for line in found), found


def test_a_wheel_of_another_version_or_platform_or_the_images_is_refused(wheelhouse, tmp_path):
    odd = tmp_path / "wheelhouse"
    shutil.copytree(wheelhouse, odd)
    (dill,) = odd.glob("dill-*.whl")
    dill.rename(odd / "dill-0.3.0-py3-none-any.whl")
    (pydantic,) = odd.glob("pydantic-*.whl")
    pydantic.rename(odd / pydantic.name.replace("py3-none-any", "cp311-cp311-win_amd64"))
    shutil.copy(next(odd.glob("sniffio-*.whl")), odd / "numpy-2.4.6-py3-none-any.whl")
    found = "\n".join(gpu_wheels.problems(odd))
    assert "dill-0.3.0-py3-none-any.whl: version 0.3.0, constraints.txt pins 0.4.1" in found, found
    assert "win_amd64.whl: not installable on CPython 3.12 / manylinux x86_64" in found, found
    assert "numpy-2.4.6-py3-none-any.whl: the image has numpy" in found, found


@pytest.mark.skipif(not (ROOT / "wheelhouse").is_dir(), reason="no wheelhouse/ here: `make gpu-wheels` builds it")
def test_the_real_wheelhouse_is_complete():
    assert gpu_wheels.problems(ROOT / "wheelhouse") == []


def _check(wheelhouse: Path, out: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WHEELHOUSE": str(wheelhouse), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    command = ["bash", "scripts/gpu_check.sh", str(out)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_without_a_gpu_the_check_says_so_after_the_wheelhouse_check(wheelhouse, tmp_path):
    done = _check(wheelhouse, tmp_path / "out")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert any(line.startswith("torch ") and "tp_train needs torch>=" in line for line in lines), done.stdout
    assert lines[-1] == "no CUDA device: the GPU check ran only its wheelhouse check (passed)", lines[-3:]
    assert (tmp_path / "out" / "gpu_check.log").read_text() == done.stdout

    (wheelhouse / "partial").mkdir()
    for wheel in wheelhouse.glob("*.whl"):
        if not wheel.name.startswith("datasets-"):
            shutil.copy(wheel, wheelhouse / "partial")
    refused = _check(wheelhouse / "partial", tmp_path / "again")
    assert refused.returncode == 1
    assert refused.stdout.splitlines()[-1].endswith("wheelhouse check (FAILED)")
    assert "wheelhouse: datasets: needed by pyproject.toml" in refused.stdout


@pytest.mark.slow
def test_the_one_device_measurement_and_the_summary(tmp_path):
    bench = tmp_path / "gpu_bench.json"
    arguments = ["--size", "small", "--no-compiled", "--seconds", "0", "--sweep", "8", "--peak-tflops", "1",
                 "--output", str(bench)]  # fmt: skip
    done = train_cases.run_module("tp_train.tools.bench.one_device", arguments, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(bench.read_text())
    assert sorted(report["contenders"]) == ["ours tp=1", "plain tp=1"]
    for row in report["contenders"].values():
        assert row["tokens_per_s"] > 0 and row["peak_mib"] > 0 and row["predicted_peak_mib"] > 0, row
        assert len(row["step_s_rounds"]) == 5 and row["step_s"] == statistics.median(row["step_s_rounds"])
        assert row["mfu"] == row["tokens_per_s"] * report["flops_per_token"] / 1e12  # --peak-tflops 1
    # The ratio: the median of the 5 rounds' own ratios, with their range.
    plain, ours = (report["contenders"][f"{kind} tp=1"]["step_s_rounds"] for kind in ("plain", "ours"))
    rounds = [slow / fast for fast, slow in zip(ours, plain, strict=True)]
    assert report["ratios"] == {"ours/plain tokens_per_s": statistics.median(rounds)}
    assert report["ratio_ranges"] == {"ours/plain tokens_per_s": [min(rounds), max(rounds)]}
    # The profile phase: busy time per step and the top operators (kernels on a GPU) for both contenders.
    for profile in report["profile"].values():
        assert profile["busy_ms_per_step"] > 0 and len(profile["top"]) == 10, profile
        assert profile["busy_ms_per_step"] >= sum(row["ms_per_step"] for row in profile["top"])
    # The micro-batch sweep: ours at the size's batch (4) and at 8, and the better of the two.
    sweep = report["sweep"]
    assert sweep["contender"] == "ours tp=1" and sorted(sweep["mfu_by_batch"]) == ["4", "8"], sweep
    assert sweep["best_mfu"] == max(sweep["mfu_by_batch"].values()) > 0
    assert sweep["mfu_by_batch"][str(sweep["best_batch"])] == sweep["best_mfu"]

    (tmp_path / "phases.tsv").write_text("versions\t0\t3\nbench\t0\t20\ntests\t124\t270\n")
    summary = subprocess.run(
        [sys.executable, "scripts/gpu_summary.py", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert summary.returncode == 1  # a phase timed out
    assert "phase tests      TIMED OUT" in summary.stdout and "ours/plain tokens_per_s" in summary.stdout
    written = json.loads((tmp_path / "gpu_check.json").read_text())
    assert written["passed"] is False and written["bench"]["contenders"] and written["tests"] is None


def test_the_summary_counts_an_expected_failure_apart_from_a_skip(tmp_path):
    (tmp_path / "cuda_tests.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_cuda_ranks" name="a" time="1.0"/>'
        '<testcase classname="tests.test_cuda_ranks" name="b" time="1.0"><failure message="boom"/></testcase>'
        '<testcase classname="tests.test_cuda_ranks" name="c" time="1.0">'
        '<skipped type="pytest.xfail" message="known segfault"/></testcase>'
        '<testcase classname="tests.test_cuda_ranks" name="d" time="0.0">'
        '<skipped type="pytest.skip" message="no CUDA device"/></testcase>'
        "</testsuite></testsuites>"
    )
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "scripts" / "gpu_summary.py")
    gpu_summary = importlib.util.module_from_spec(spec)  # a script, not a package the wheelhouse check counts
    spec.loader.exec_module(gpu_summary)
    counts = gpu_summary.tests(tmp_path)["counts"]
    assert counts == {"passed": 1, "failed": 1, "xfailed": 1, "skipped": 1}, counts


def test_the_peak_flops_table_tells_the_h100s_apart_and_knows_the_h200():
    from tp_train.tools.bench.one_device import peak_flops

    names = {
        "NVIDIA H100 80GB HBM3": 989e12,  # SXM
        "NVIDIA H100 PCIe": 756e12,
        "NVIDIA H100 NVL": 835e12,
        "NVIDIA H200": 989e12,
        "NVIDIA H200 NVL": 835e12,
        "NVIDIA A100-SXM4-80GB": 312e12,
    }
    assert {name: peak_flops(name) for name in names} == names
    assert peak_flops("NVIDIA GeForce RTX 4090") is None and peak_flops(None) is None
