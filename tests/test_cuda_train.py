"""The CUDA path through the training app, as users run it (`python train.py`, one GPU, NCCL at tp=1): bf16 and
fp16 mixed precision (CUDA's grad scaler), preempted and resumed with the uninterrupted run's losses (CUDA's RNG
state and the scaler's restored); LoRA fine-tuning of README's tiny Llama on the GPU with the CPU's first losses;
`tp-train-generate` on the GPU printing the CPU's greedy text from the same checkpoint.

Marked `cuda` and skipped without a GPU: scripts/gpu_check.sh runs them on a GPU machine."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from tests.test_finetune import NEW_TOKENS, PROMPT, _losses, _summary, _train, readme_snippet
from tests.test_preemption import assert_resumed_with_the_same_losses, preemption_command, straight_preempted_resumed

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it on one)"),
]
ROOT = Path(__file__).resolve().parents[1]
ON_GPU = "GPU available: True (cuda), used: True"  # Lightning's line at the start of a run
ON_CPU = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_train_py_on_the_gpu_resumes_with_the_uninterrupted_losses(tmp_path, precision):
    command = preemption_command(tmp_path, "tp=1", f"precision={precision}")
    processes, run_dirs = straight_preempted_resumed(tmp_path, command)
    for process in processes:
        assert ON_GPU in process.stdout + process.stderr, process.stderr[-3000:]
    assert f"resuming from {run_dirs[1] / 'checkpoints' / 'last.ckpt'}" in processes[2].stderr
    assert_resumed_with_the_same_losses(run_dirs)


def _generate(checkpoint: Path, env: dict | None = None) -> str:
    """`tp-train-generate`'s greedy continuation of PROMPT (the console script beside the interpreter, else its
    module)."""
    script = Path(sys.executable).parent / "tp-train-generate"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "tp_train.app.generate"]
    command += [str(checkpoint), "--tp", "1", "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS)]
    result = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_lora_fine_tuning_and_generation_on_the_gpu_match_the_cpu(tmp_path):
    subprocess.run([sys.executable, "-c", readme_snippet()], cwd=tmp_path, check=True, capture_output=True, timeout=300)
    stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    (tmp_path / "corpus.txt").write_text("\n\n".join(p.read_text(errors="replace") for p in stdlib[40:70]))
    lora = ["model=hf", f"model.path={tmp_path / 'tiny-llama'}", "peft=lora", "trainer.max_steps=10", "tp=1"]
    gpu = _train(tmp_path, "gpu", "corpus.txt", *lora)
    cpu = _train(tmp_path, "cpu", "corpus.txt", *lora, env=ON_CPU)

    summary = _summary(gpu)
    assert summary["steps"] == 10 and 0 < summary["trainable_parameters"] < 0.1 * summary["parameters"], summary
    on_gpu, on_cpu = _losses(gpu), _losses(cpu)
    assert len(on_gpu) == 10 and on_gpu[-1] < on_gpu[0], on_gpu
    # The same weights and batch: step 0's loss differs by summation order only; later steps by what Adam makes
    # of that.
    assert abs(on_gpu[0] - on_cpu[0]) < 1e-4, (on_gpu, on_cpu)
    assert max(abs(a - b) for a, b in zip(on_gpu[:5], on_cpu[:5], strict=True)) < 1e-2, (on_gpu, on_cpu)

    checkpoint = gpu / "checkpoints" / "last.ckpt"
    text = _generate(checkpoint)
    assert text.endswith("\n") and len(text) > 1, repr(text)
    assert text == _generate(checkpoint, env=ON_CPU), "the GPU's greedy text differs from the CPU's"
