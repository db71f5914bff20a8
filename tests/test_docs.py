"""The docs as a newcomer meets them: the site builds with `mkdocs build --strict`; every shell block of the README
and of docs/ names the tests that run its commands, or says what it needs that CI does not have (a GPU, a
cluster); the commands named here run: `python train.py ...` lines compose, the README's own-model recipe trains at
tp=2, the FSDP snippet without Lightning shards a model as the unsharded one computes, the make targets run the
documented commands, and the README's batch script is scripts/slurm.sbatch."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import train_cases
from tests.distributed import free_port, run_on_ranks
from tests.docs_examples import ROOT, example, shell_blocks

NEEDS = re.compile(r"needs (a GPU|a cluster|a W&B account and network)$")
TEST_REFERENCE = re.compile(r"(tests/\w+\.py)::(\w+)$")


def test_the_docs_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "scontrol requeue" in (tmp_path / "site" / "cluster" / "index.html").read_text()  # included files too


def test_every_shell_block_names_the_tests_that_run_it_or_what_it_needs():
    """Each `docs-commands:` item is a test that exists (file and function), `.ci/run`, or a need CI lacks."""
    problems = []
    for block in shell_blocks():
        if block.marker is None:
            problems.append(f"{block.where}: no <!-- docs-commands: ... --> comment above the block")
            continue
        for item in (part.strip() for part in block.marker.split(";")):
            reference = TEST_REFERENCE.match(item)
            if reference:
                path, name = ROOT / reference.group(1), reference.group(2)
                if not path.exists() or not re.search(rf"^def {name}\(", path.read_text(), re.M):
                    problems.append(f"{block.where}: {item} is not a test")
            elif item != ".ci/run" and not NEEDS.match(item):
                problems.append(f"{block.where}: {item!r} is neither tests/x.py::test_y, .ci/run nor 'needs ...'")
    assert not problems, "\n".join(problems)
    assert len(shell_blocks()) >= 15  # the parser still finds the blocks


def _documented_train_overrides() -> list[tuple[str, list[str]]]:
    """(where, overrides) of every `python train.py` line in a block this test is named for; a sweep (`-m a=1,2`)
    gives one entry per value, and a placeholder the reader fills in (`outputs/<run>/...`) a name."""
    runs = []
    for block in shell_blocks():
        if "test_documented_train_commands_compose" not in (block.marker or ""):
            continue
        for command in block.commands():
            words = shlex.split(re.sub(r"<(\w+)>", r"\1", command), comments=True)
            if words[:2] != ["python", "train.py"]:
                continue
            overrides = [word for word in words[2:] if not word.startswith("-")]
            sweeps = [(i, word.split("=", 1)) for i, word in enumerate(overrides) if "-m" in words and "," in word]
            variants = [overrides]
            for index, (key, values) in sweeps:
                variants = [
                    [*v[:index], f"{key}={value}", *v[index + 1 :]] for v in variants for value in values.split(",")
                ]
            runs += [(block.where, variant) for variant in variants]
    return runs


@pytest.mark.slow
def test_documented_train_commands_compose(tmp_path):
    """Every documented `python train.py ...` line names config groups, options and keys that exist: Hydra
    composes it (an unknown key or option is an error there)."""
    from tests.test_configs import _compose

    runs = _documented_train_overrides()
    assert len(runs) >= 10, runs
    for where, overrides in runs:
        try:
            _compose(tmp_path, overrides)
        except Exception as error:  # noqa: BLE001 - the message names the command
            pytest.fail(f"{where}: python train.py {' '.join(overrides)}: {error}")


def _checkout_with_mine(directory: Path) -> Path:
    """The own-model recipe as a user follows it, in a copy of train.py and conf/: docs/own-models.md's TinyLM saved
    as mine.py beside train.py, the README's YAML as conf/model/mine.yaml (the repository's own conf/ stays as it is,
    for the tests beside this one that list its model options)."""
    shutil.copytree(ROOT / "conf", directory / "conf")
    shutil.copy(ROOT / "train.py", directory / "train.py")
    (directory / "mine.py").write_text(example("custom-model"))
    (directory / "conf" / "model" / "mine.yaml").write_text(example("mine-yaml"))
    return directory


def test_the_readme_recipe_is_the_worked_example():
    """The README's plan is the worked example's, and its YAML the one docs/own-models.md gives."""
    namespace = {"__name__": "mine"}
    exec(compile(example("custom-model"), "docs/own-models.md", "exec"), namespace)
    readme_class = ast.parse(example("readme-plan").replace("...", "pass"))
    (plan,) = [node.value for node in ast.walk(readme_class) if isinstance(node, ast.Assign)]
    assert ast.literal_eval(plan) == namespace["TinyLM"].tp_plan
    strip = lambda text: [line.split("#")[0].rstrip() for line in text.splitlines() if line.split("#")[0].strip()]  # noqa: E731
    assert strip(example("mine-yaml-page")) == strip(example("mine-yaml"))


@pytest.mark.slow
def test_your_own_model_trains_with_train_py_at_tp2(tmp_path):
    """`python train.py model=mine tp=2 trainer.max_steps=20`, as documented (a smaller corpus and vocabulary)."""
    checkout = _checkout_with_mine(tmp_path / "checkout")
    env = {**os.environ, "WANDB_MODE": "offline", "TP_TRAIN_CACHE": str(tmp_path / "cache")}
    command = [sys.executable, "train.py", "model=mine", "tp=2", "trainer.max_steps=20", "logger=none",
               "data.max_files=20", "data.vocab_size=300", "data.block_size=32", "trainer.limit_val_batches=1",
               f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    result = subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 20 and len(summary["peak_memory_mib_per_rank"]) == 2, summary
    assert summary["train_loss"] < summary["first_train_loss"], summary


def _fsdp_snippet(rank, world_size):
    """docs/cluster.md's FSDP2 block without Lightning, as torchrun would run it: the harness's group makes way for
    the one the block starts. Returns its logits, those of the unsharded model, and the parameters this rank holds."""
    import torch.distributed as dist

    from models import GPT, GPTConfig

    port = [free_port() if rank == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ["MASTER_PORT"] = str(port[0])
    namespace = {"__name__": "__main__"}
    exec(compile(example("fsdp-without-lightning"), "docs/cluster.md", "exec"), namespace)
    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=64, dropout=0.0))
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sharded, expected = namespace["model"](idx), plain(idx)
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in namespace["model"].parameters())
    dist.destroy_process_group()
    return (sharded - expected).abs().max().item(), local, sum(p.numel() for p in plain.parameters())


@pytest.mark.slow
def test_the_fsdp_snippet_without_lightning_shards_over_dp_and_tp_and_computes_the_same():
    for error, local, total in run_on_ranks(_fsdp_snippet, 4):
        assert error < 1e-5, error
        assert local < 0.3 * total, (local, total)  # about a quarter: split over tp=2, then over dp=2


def test_make_targets_run_the_documented_commands():
    """`make -n`: train is train.py tp=2, test the whole suite, test-fast the tests not marked slow, docs the
    strict build; each after set-up."""
    env = {key: value for key, value in os.environ.items() if key not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    command = ["make", "-n", "--no-print-directory", "PYTHON=python", "train", "test", "test-fast", "docs"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=True)
    lines = result.stdout.splitlines()
    assert any(line.endswith("python train.py tp=2") for line in lines), lines
    assert "python -m pytest -q -n 3 --dist loadfile" in lines, lines
    assert 'python -m pytest -q -n 2 --dist loadfile -m "not slow"' in lines, lines
    assert "python -m mkdocs build --strict" in lines, lines
    assert lines[0] == "PYTHON=python bash scripts/setup.sh", lines  # set-up first (once: make runs a target once)


def test_the_readme_sbatch_script_is_scripts_slurm_sbatch():
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / "scripts" / "slurm.sbatch").read_text()
    (copy,) = re.findall(r"```bash\n(#!/bin/bash\n.*?)```", readme, re.S)
    assert copy == script
    subprocess.run(["bash", "-n", str(ROOT / "scripts" / "slurm.sbatch")], check=True, timeout=30)
    for directive in ("--requeue", "--signal=USR1@", "scontrol requeue", "hydra.run.dir="):
        assert directive in script, directive


def test_documented_zoo_commands_parse():
    """Each option a documented zoo command uses is one the zoo's command line takes."""
    result = train_cases.run_module("tp_train.tools.zoo", ["--help"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    help_text = result.stdout
    options = {
        word
        for block in shell_blocks()
        if "tools.zoo" in block.text
        for command in block.commands()
        for word in shlex.split(command, comments=True)
        if word.startswith("--")
    }
    assert options and all(option in help_text for option in options), (options, help_text)


def test_every_test_conftest_marks_slow_exists():
    """tests/conftest.py's SLOW_HERE names tests by file and function: a renamed test would leave the list, and run
    in the fast tier again, unnoticed."""
    from tests.conftest import SLOW_HERE

    for entry in SLOW_HERE:
        path, name = entry.split("::")
        assert re.search(rf"^def {name}\(", (ROOT / "tests" / path).read_text(), re.M), entry
