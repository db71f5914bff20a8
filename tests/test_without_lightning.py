"""docs/without-lightning.md's plain PyTorch loop at pp=2 x tp=2, run as written by torchrun (four fresh processes, no
Lightning imported), equals one process: 10 AdamW steps with clipping, the losses and every final parameter within
1e-5."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.docs_examples import example

ROOT = Path(__file__).resolve().parents[1]
STEPS = 10
TOLERANCE = 1e-5

# Runs the page's `main` on each rank, then saves its losses and its stages' parameters gathered whole over the
# tensor-parallel ranks (each pipeline stage's first tensor-parallel rank writes them).
DRIVER = """
import json, sys
import torch
import torch.distributed as dist
from tp_train import full_state_dict
import plain_loop

losses, model, training = plain_loop.main({steps})
state = full_state_dict(model, training.mesh.tensor_parallel.get_group())
if training.mesh.tensor_parallel.get_local_rank() == 0:
    torch.save(state, "stage%d.pt" % training.mesh.pipeline_parallel.get_local_rank())
if dist.get_rank() == 0:
    json.dump({{"losses": losses, "lightning": [name for name in sys.modules if name.startswith("lightning")]}},
              open("result.json", "w"))
dist.destroy_process_group()
"""


def _one_process(loop) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = loop.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop.LEARNING_RATE)
    losses = []
    for ids, targets in loop.batches(STEPS):
        optimizer.zero_grad()
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), loop.MAX_NORM)
        assert norm > loop.MAX_NORM  # the clipping scales every step's gradients: its norm is tested
        optimizer.step()
        losses.append(loss.item())
    return losses, {name: param.detach() for name, param in model.named_parameters(remove_duplicate=False)}


@pytest.mark.slow
def test_the_plain_loop_at_pp2_tp2_equals_one_process_without_importing_lightning(tmp_path):
    (tmp_path / "plain_loop.py").write_text(example("plain-loop"))
    (tmp_path / "driver.py").write_text(DRIVER.format(steps=STEPS))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "driver.py"]
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:  # each rank's traceback, then torchrun's summary
        errors = [line for line in done.stderr.splitlines() if "Error" in line or "error" in line]
        raise AssertionError("\n".join(errors[:20]) + "\n" + done.stderr[-2000:])
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["lightning"] == [], result["lightning"]

    spec = importlib.util.spec_from_file_location("plain_loop", tmp_path / "plain_loop.py")
    loop = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loop)  # the page's model and batches, in this process
    expected_losses, expected = _one_process(loop)
    errors = [abs(a - b) for a, b in zip(result["losses"], expected_losses, strict=True)]
    print(f"losses within {max(errors):.1e}")
    assert max(errors) < TOLERANCE, (result["losses"], expected_losses)
    stages = [torch.load(tmp_path / f"stage{stage}.pt") for stage in range(2)]
    # every parameter on one stage (a tied one under each of its names, on the stages using it), each equal
    held = {name: value for stage in stages for name, value in stage.items() if name in expected}
    assert sorted(held) == sorted(expected), sorted(set(expected) - set(held))
    errors = {name: (value - expected[name]).abs().max().item() for name, value in held.items()}
    print(f"final parameters within {max(errors.values()):.1e}")
    assert max(errors.values()) < TOLERANCE, max(errors.items(), key=lambda item: item[1])
