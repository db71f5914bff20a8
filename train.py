"""Train a language model with tensor parallelism: `python train.py tp=2 precision=16`.

Hydra composes conf/train.yaml; everything is built from its `_target_` entries, trained with Lightning, and the
run ends with a short summary (also written to `summary.json` in the run directory).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import warnings
from pathlib import Path

# The exit status of a `main()` that returned or called `sys.exit` (empty while it runs, and when it raised).
_ENDED: list[int] = []


def _end_without_teardown() -> None:
    """Registered before any library is imported, so it runs after every other atexit handler (W&B's finish,
    the data loaders', logging's): once the run has ended, the process ends with its status at once, without the
    interpreter freeing torch, Lightning and transformers object by object, which took each rank 1.5-5 s on a
    2-core machine after the work was done. A run that raised ends the usual way."""
    if _ENDED:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_ENDED[0])


atexit.register(_end_without_teardown)

import hydra
import lightning as L
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from tp_train import TensorParallelMixedPrecision
from tp_train.app import preflight, resume
from tp_train.app.auto_layout import AUTO, apply_auto_layout
from tp_train.app.command_line import quote_paths
from tp_train.app.module import CausalLMModule
from tp_train.app.preflight import estimate_for_config
from tp_train.app.resolvers import lightning_precision, register_resolvers
from tp_train.errors import CheckpointError, DiskFullError
from tp_train.lightning import watchdog
from tp_train.lightning.metrics import TrainingMetrics, peak_memory_mib
from tp_train.lightning.preemption import Preempted
from tp_train.tools.tokenizer import RUN_TOKENIZER

register_resolvers()
# Lightning 2.6's CombinedLoader builds torch's `LeafSpec()`, which torch 2.13 deprecates with a FutureWarning on
# every rank ("`isinstance(treespec, LeafSpec)` is deprecated"): nothing a user can change. Only that message,
# and only from that Lightning module, is silenced.
warnings.filterwarnings(
    "ignore",
    message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    category=FutureWarning,
    module=r"lightning\.pytorch\.utilities\._pytree",
)


def build_trainer(cfg: DictConfig) -> L.Trainer:
    precision = lightning_precision(cfg.precision)
    plugins = []
    if precision == "16-mixed" and not torch.cuda.is_available():
        # Lightning would silently train in bf16 on CPU; fp16 with a TP-aware loss scaler is what was asked for.
        plugins.append(TensorParallelMixedPrecision("16-mixed", "cpu"))
        precision = None
    callbacks = [instantiate(callback) for callback in (cfg.get("callbacks") or {}).values()]
    if cfg.get("samples") and cfg.samples.get("prompts"):
        callbacks.append(instantiate(cfg.samples))
    logger = instantiate(cfg.logger) if cfg.get("logger") else False
    return instantiate(cfg.trainer, precision=precision, plugins=plugins, callbacks=callbacks, logger=logger)


def end_progress_bars(trainer: L.Trainer) -> None:
    """Closes the progress bars a fit that raised left open (Lightning's TQDM bar has no exception hook): the train
    bar ends its line, the validation bar clears its own, so an error printed next starts on its own line."""
    callback = trainer.progress_bar_callback
    for name in ("_val_progress_bar", "_train_progress_bar"):
        bar = getattr(callback, name, None)
        if bar is not None and not bar.disable:
            bar.close()


def summarize(trainer: L.Trainer) -> dict | None:
    """The run's outcome, on rank 0 (every rank must call: peak memory is gathered)."""
    device = trainer.strategy.root_device
    monitor = next((c for c in trainer.callbacks if isinstance(c, TrainingMetrics)), None)
    setup_peak = monitor.setup_peak_mib if monitor and monitor.setup_peak_mib is not None else float("nan")
    peak = torch.tensor([peak_memory_mib(device), setup_peak], device=device)
    peaks = [peak]
    if torch.distributed.is_initialized():  # a plain collective: Lightning's all_gather uses torch's deprecated one
        peaks = [torch.empty_like(peak) for _ in range(trainer.world_size)]
        torch.distributed.all_gather(peaks, peak)
    peaks, setup_peaks = torch.stack(peaks).reshape(-1, 2).unbind(1)
    if not trainer.is_global_zero:
        return None
    metrics = {name: value.item() for name, value in trainer.callback_metrics.items()}
    wandb_dir = None
    if isinstance(trainer.logger, L.pytorch.loggers.WandbLogger) and not getattr(trainer.logger, "failed", None):
        wandb_dir = str(Path(trainer.logger.experiment.dir).parent)  # None: W&B failed, which the run said once
    return {
        **_tokenizer(trainer.datamodule),
        "steps": trainer.global_step,
        "parameters": monitor.parameters if monitor else None,
        "trainable_parameters": monitor.trainable_parameters if monitor else None,
        "parameters_on_rank": monitor.parameters_on_rank if monitor else None,  # rank 0's own: its stages' shards
        "first_train_loss": monitor.first_loss if monitor else None,
        "train_loss": metrics.get("train/loss"),
        "val_loss": metrics.get("val/loss"),
        "val_ppl": metrics.get("val/ppl"),
        "tokens_per_sec": monitor.tokens_per_sec if monitor else None,
        "peak_memory_mib_per_rank": [round(p, 1) for p in peaks.tolist()],
        # building, sharding and cutting the model, above what each rank held before (null where not measured)
        "setup_peak_memory_mib_per_rank": [None if p != p else round(p, 1) for p in setup_peaks.tolist()],
        "checkpoint": trainer.checkpoint_callback.last_model_path if trainer.checkpoint_callback else None,
        "wandb_run": wandb_dir,
    }


def _tokenizer(datamodule) -> dict:
    """Which tokenizer the run used: a path (a pretrained model's, `data.tokenizer_path`, or the one trained on the
    corpus in the data cache)."""
    return {"tokenizer": getattr(datamodule, "tokenizer_source", None)}


def resume_from(cfg: DictConfig) -> str | None:
    """The checkpoint to resume from: `ckpt_path`, or with `ckpt_path=auto` this command's last run's (see
    tp_train.app.resume), decided by the launching process and passed to its child ranks."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    unresolved = OmegaConf.to_container(hydra_cfg, resolve=False)  # the template, before ${now:...} is filled in
    if hydra_cfg.mode == RunMode.MULTIRUN:
        template = f"{unresolved['sweep']['dir']}/{unresolved['sweep']['subdir']}"
    else:
        template = unresolved["run"]["dir"]
    overrides = list(hydra_cfg.overrides.task)
    ckpt_path = resume.resolve(cfg.ckpt_path, template, run_dir, overrides, elastic=cfg.get("parallel") == AUTO)
    if rank_zero_only.rank == 0:
        os.environ[resume.ENVIRONMENT_VARIABLE] = ckpt_path or ""  # Lightning's launcher copies it to the ranks
        if ckpt_path is not None:
            how = ", the newest complete checkpoint of this command's last run" if cfg.ckpt_path == resume.AUTO else ""
            print(f"resuming from {ckpt_path}{how}", file=sys.stderr)
    return ckpt_path


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # A multirun (-m tp=1,2) runs its jobs in this one process: each job starts from the same environment and
    # leaves no process group behind (Lightning's launcher sets rank variables in os.environ).
    environ = dict(os.environ)
    try:
        return run(cfg)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        os.environ.clear()
        os.environ.update(environ)


def run(cfg: DictConfig) -> float | None:
    try:
        layouts = apply_auto_layout(cfg, list(HydraConfig.get().overrides.task), rank_zero_only.rank)
        if layouts is not None:  # parallel=auto, on the launching process: what it chose among
            print(layouts, flush=True)
        preflight.check_in_launching_process(cfg, lambda: instantiate(cfg.model), rank_zero_only.rank)
        if rank_zero_only.rank == 0 and layouts is None:  # the launching process (auto printed the simulated memory)
            try:
                estimate = estimate_for_config(cfg, lambda: instantiate(cfg.model))
            except ValueError as error:  # a model of your own whose config gives no layer count or width: advisory
                print(f"note: no memory estimate: {error}", flush=True)
            else:
                print(estimate.table(f"predicted memory per rank ({preflight.layout_label(cfg)})"), flush=True)
        if cfg.get("dry_run"):
            return None
        datamodule = instantiate(cfg.data)
        if rank_zero_only.rank == 0:  # the launching process: data errors surface before any rank starts
            datamodule.prepare_data()
            with torch.device("meta"):  # shapes only
                model = instantiate(cfg.model)()
            preflight.check_tokenizer(cfg, datamodule.vocab_size, datamodule.tokenizer_source, model)
            # The run's own copy (JSON), which generation and export read the model's token ids with.
            datamodule.tokenizer.save_pretrained(Path(HydraConfig.get().runtime.output_dir) / RUN_TOKENIZER)
        trainer = build_trainer(cfg)
        # Taken once, by rank 0, for every rank: ranks that each looked for themselves could start apart.
        ckpt_path = trainer.strategy.rank_zero_decides(lambda: resume_from(cfg))
        preflight.check_checkpoint(ckpt_path, cfg.trust_checkpoint)  # the one `ckpt_path=auto` found, too
    except preflight.ConfigError as error:  # a user error: one line, no traceback, status 2
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    L.seed_everything(cfg.seed, workers=True)
    module = CausalLMModule(
        model=instantiate(cfg.model),
        optimizer=instantiate(cfg.optimizer),
        scheduler=instantiate(cfg.scheduler) if cfg.get("scheduler") else None,
        adapters=instantiate(cfg.peft) if cfg.get("peft") else None,
    )
    if trainer.logger:
        trainer.logger.log_hyperparams({**OmegaConf.to_container(cfg, resolve=True), **_tokenizer(datamodule)})
    try:
        try:
            trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        except BaseException:
            end_progress_bars(trainer)  # what is printed next starts on its own line, not glued to a bar's
            raise
    except Preempted as stop:  # a checkpoint was saved: exit cleanly (status 0) with one line
        if trainer.is_global_zero:
            print(stop, file=sys.stderr)
        sys.exit(0)  # the process, a multirun's later jobs included: the machine is being taken away
    except DiskFullError as error:  # one line, status 1; every complete checkpoint is as it was
        if trainer.is_global_zero:
            print(f"error: {error}", file=sys.stderr)
        sys.exit(1 if trainer.is_global_zero else watchdog.USER_ERROR_STATUS)  # rank 0 alone reports it
    except CheckpointError as error:  # a checkpoint of another model or plan: one line, status 2, nothing changed
        if trainer.is_global_zero:
            found = "; ckpt_path=auto found it, ckpt_path=null starts fresh" if cfg.ckpt_path == "auto" else ""
            print(f"error: ckpt_path: {error}{found}", file=sys.stderr)
        sys.exit(2)
    summary = summarize(trainer)
    if summary is None:
        return None
    if cfg.get("chosen_layout"):
        summary["chosen_layout"] = OmegaConf.to_container(cfg.chosen_layout)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    width = max(len(key) for key in summary)
    print("\n".join(["", "run summary:", *(f"  {key:<{width}}  {value}" for key, value in summary.items())]))
    return summary["val_loss"]


if __name__ == "__main__":
    quote_paths(sys.argv)  # before Hydra parses it: a checkpoint path pasted as a run printed it
    try:
        main()
    except SystemExit as stop:  # sys.exit(2) for a user error; Hydra's sys.exit(1) after reporting an exception
        _ENDED.append(stop.code if isinstance(stop.code, int) else int(stop.code is not None))
        raise
    _ENDED.append(0)
