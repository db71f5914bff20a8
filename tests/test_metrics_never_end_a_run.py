"""A metric never ends a run (issue 41): TrainingMetrics' FLOP counter, memory probe and logging, and
ValidationSamples' table, that raise leave the run training with one warning each and the metric unlogged. On one
device: the counting and logging are the same on every rank (the Mixtral run of tests/test_hf_train.py is the
multi-rank case, whose grouped-GEMM experts the meta-device counter refuses)."""

from __future__ import annotations

import functools
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader

import tp_train
import tp_train.lightning.metrics as metrics_module
from models import GPT, GPTConfig

VOCAB = 64
STEPS = 3


def _fit(callbacks, logger=False) -> tuple[L.Trainer, list[str]]:
    torch.manual_seed(0)
    build = functools.partial(GPT, GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16))
    module = tp_train.CausalLMModule(build, functools.partial(torch.optim.AdamW, lr=1e-3))
    data = DataLoader(torch.randint(0, VOCAB, (4 * STEPS, 9)), batch_size=4)
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=logger, callbacks=callbacks, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, log_every_n_steps=1,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    return trainer, [str(warning.message) for warning in caught if "failed (" in str(warning.message)]


def _known_peak(monkeypatch):
    """A CPU has no known peak FLOP/s: give it one, so MFU is logged whenever FLOPs are counted."""
    monkeypatch.setattr(metrics_module, "get_available_flops", lambda device, dtype: 1e12)


def test_counted_flops_log_mfu(monkeypatch):
    _known_peak(monkeypatch)
    trainer, failures = _fit([tp_train.TrainingMetrics(window_size=2)])
    assert trainer.global_step == STEPS and not failures
    assert "throughput/mfu" in trainer.callback_metrics


def test_a_flop_counter_that_raises_leaves_the_run_training_with_one_warning_and_no_mfu(monkeypatch):
    _known_peak(monkeypatch)
    calls = []

    def refuse(*args, **kwargs):  # what torch._grouped_mm does for fp32 experts on the meta device
        calls.append(1)
        raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32")

    monkeypatch.setattr(metrics_module, "measure_flops", refuse)
    callback = tp_train.TrainingMetrics(window_size=2)
    trainer, failures = _fit([callback])
    assert trainer.global_step == STEPS
    assert len(calls) == 2, "counted again after it failed (once in the model's dtype, once in bf16, then never)"
    assert failures == [
        "TrainingMetrics: counting FLOPs failed (RuntimeError: Expected inputs of BF16 type but got "
        "mat_a.dtype=torch.float32); FLOPs/s and MFU are not logged; training goes on"
    ]
    assert "throughput/mfu" not in trainer.callback_metrics
    assert "throughput/flops_per_sec" not in trainer.callback_metrics
    assert "throughput/tokens_per_sec" in trainer.callback_metrics and callback.first_loss is not None


def test_a_memory_probe_and_a_logger_that_raise_leave_the_run_training(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise OSError("no such file: /proc/self/status")

    monkeypatch.setattr(metrics_module, "peak_memory_mib", broken)

    class BrokenLogger(L.pytorch.loggers.CSVLogger):
        def log_hyperparams(self, params, *args, **kwargs):
            raise ConnectionError("wandb: network unreachable")

    trainer, failures = _fit([tp_train.TrainingMetrics(window_size=2)], logger=BrokenLogger(tmp_path))
    assert trainer.global_step == STEPS
    assert len(failures) == 2, failures
    assert any("probing peak memory failed (OSError" in failure for failure in failures)
    assert any("logging the run's sizes failed (ConnectionError" in failure for failure in failures)
    assert "memory/peak_mib" not in trainer.callback_metrics and "train/loss" in trainer.callback_metrics


def test_a_samples_table_that_cannot_be_written_leaves_the_run_training(monkeypatch, tmp_path):
    class Tokenizer:
        eos_token_id = 0

        def encode(self, text, add_special_tokens=False):
            return [1, 2]

        def decode(self, ids):
            return " ".join(map(str, ids))

    class Data(L.LightningDataModule):
        tokenizer = Tokenizer()

        def train_dataloader(self):
            return DataLoader(torch.randint(0, VOCAB, (4 * STEPS, 9)), batch_size=4)

        def val_dataloader(self):
            return DataLoader(torch.randint(0, VOCAB, (4, 9)), batch_size=4)

    def unwritable(*args, **kwargs):
        raise OSError("[Errno 28] No space left on device")

    monkeypatch.setattr("builtins.print", unwritable)  # the table without W&B: one line per prompt
    torch.manual_seed(0)
    build = functools.partial(GPT, GPTConfig(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, n_embd=16))
    module = tp_train.CausalLMModule(build, functools.partial(torch.optim.AdamW, lr=1e-3))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, val_check_interval=1, limit_val_batches=1,
        num_sanity_val_steps=0, callbacks=[tp_train.ValidationSamples(prompts=["a"], max_new_tokens=2)],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, datamodule=Data())
    failures = [str(w.message) for w in caught if "failed (" in str(w.message)]
    assert trainer.global_step == STEPS
    assert len(failures) == 1 and "writing the samples table failed (OSError" in failures[0], failures


def test_flops_of_grouped_gemm_experts_are_counted_in_bf16_on_the_meta_device():
    """Mixtral's experts (torch._grouped_mm) refuse fp32 on meta: the count runs again in bf16, the same FLOPs."""
    from types import SimpleNamespace

    from models import hugging_face_causal_lm

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=4)  # fmt: skip
    module = SimpleNamespace(_model_factory=functools.partial(hugging_face_causal_lm, "mixtral", config=config))
    assert tp_train.TrainingMetrics()._measure_flops(module, 2, 8) > 0


def test_a_wandb_that_fails_leaves_the_run_training_with_one_warning(monkeypatch, tmp_path):
    """`wandb.init` raising (an online run without network) is one warning; every later log call is skipped."""
    import wandb

    def unreachable(*args, **kwargs):
        raise ConnectionError("wandb: network unreachable")

    monkeypatch.setattr(wandb, "init", unreachable)
    logger = tp_train.WandbLogger(project="tp_train", save_dir=str(tmp_path), mode="offline")
    trainer, failures = _fit([tp_train.TrainingMetrics(window_size=2)], logger=logger)
    assert trainer.global_step == STEPS and "train/loss" in trainer.callback_metrics
    assert failures == [
        "WandbLogger: logging to W&B failed (ConnectionError: wandb: network unreachable); nothing more is sent to "
        "W&B; training goes on"
    ]
    assert logger.failed == "ConnectionError: wandb: network unreachable"
