"""Checks a training config in the launching process, before any rank starts or any weight loads."""

from __future__ import annotations

import glob
import os
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from tp_train.app.config_values import check_values
from tp_train.app.expert_checks import check_experts
from tp_train.app.pipeline_checks import check_pipeline
from tp_train.app.resolvers import lightning_precision
from tp_train.checkpoint import consolidated
from tp_train.checkpoint.checks import check_files
from tp_train.checkpoint.pretrained import weight_files
from tp_train.errors import CheckpointError, ConfigError, UnsafeCheckpointError
from tp_train.lightning.nonfinite import ACTIONS
from tp_train.parallel.context_parallel.models import check_context_parallel
from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.invariant import INVARIANT, LEAVES, check_numerics
from tp_train.parallel.mesh import DATA_PARALLEL_MODES
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import resolve_plan
from tp_train.plan.meta_init import deferred_init
from tp_train.plan.probe_input import run_without_cache
from tp_train.tools.family_configs import departures, unset_fields
from tp_train.tools.memory import MemoryEstimate, estimate_memory
from tp_train.training.apply_order import check_invariant_dims

# Set by a launching process whose config passed `check`: the child ranks Lightning's launcher starts from it (with a
# copy of its environment and its composed config) skip the check, which builds the model, resolves its plan and
# runs a batch on the meta device. Ranks a cluster starts (torchrun, SLURM) each check for themselves.
PASSED_ENVIRONMENT_VARIABLE = "TP_TRAIN_PREFLIGHT_PASSED"


def check_in_launching_process(cfg: DictConfig, build_model: Callable[[], torch.nn.Module], rank: int) -> None:
    """`check`, unless this process is a child rank of a launching process that passed it; on rank 0 it then marks
    the environment its child ranks inherit."""
    if os.environ.get(PASSED_ENVIRONMENT_VARIABLE) == "1":
        return
    check(cfg, build_model)
    if rank == 0:
        os.environ[PASSED_ENVIRONMENT_VARIABLE] = "1"


def check(cfg: DictConfig, build_model: Callable[[], torch.nn.Module]) -> None:
    """Raises `ConfigError` for the first problem found in `cfg`; `build_model()` builds the model's factory."""
    try:
        lightning_precision(cfg.precision)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    tp = cfg.tp
    if not isinstance(tp, int) or tp < 1:
        raise ConfigError(f"tp={tp} must be a positive integer (the tensor-parallel size), e.g. tp=2")
    check_values(cfg)
    cp = cfg.get("cp", 1)
    if not isinstance(cp, int) or cp < 1:
        raise ConfigError(f"cp={cp} must be a positive integer (the context-parallel size), e.g. cp=2")
    mode = str(_setting(cfg, "data_parallel", "ddp"))
    if mode not in DATA_PARALLEL_MODES:
        raise ConfigError(
            f"data_parallel={mode}: use data_parallel=ddp (each data-parallel rank holds its whole tensor-parallel "
            f"shard) or data_parallel=fsdp (shards, gradients and AdamW states split over the data-parallel ranks)"
        )
    try:
        dims = config_dims(cfg)
        if dims is not None:
            dims.validate("trainer.devices", cfg.trainer.get("num_nodes", 1))
        _check_numerics(cfg, dims)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    block_size = cfg.data.get("block_size")
    if cp > 1 and isinstance(block_size, int) and block_size % (2 * cp):
        raise ConfigError(
            f"data.block_size={block_size} is not a multiple of 2 x cp = {2 * cp} (each context-parallel rank holds "
            f"two equal chunks of every sequence); use data.block_size={block_size - block_size % (2 * cp) or 2 * cp}"
        )
    _check_data_source(cfg.data)
    check_checkpoint(cfg.get("ckpt_path"), cfg.get("trust_checkpoint", False))
    _check_pretrained(cfg.model)
    _check_fault_handling(cfg)
    try:
        with deferred_init():  # as the strategy builds it: shapes only, but the values its constructor computes
            model = build_model()()
    except Exception as error:  # noqa: BLE001 - a family's own constructor may raise anything; named in one line
        if _from_family(cfg):
            raise _family_refusal(cfg, "be built", error) from None
        if not isinstance(error, (ValueError, TypeError)):
            raise
        raise ConfigError(f"model: {error}") from None
    try:
        experts_whole = cfg.get("ep", 1) > 1  # as the strategy plans it: the experts whole on every rank
        match_plan(model, resolve_plan(model, tensor_parallel_size=tp, experts_whole=experts_whole)[0], tp)
        plan_error = None
    except ValueError as error:
        plan_error = error
    model.to("meta")  # shapes only from here on
    _check_one_batch(cfg, model)  # a model that cannot run says so before its plan does
    if plan_error is not None:
        raise ConfigError(f"model={type(model).__name__} at tp={tp}: {plan_error}") from None
    check_pipeline(cfg, model, dims)
    check_experts(cfg, model)
    if cp > 1:
        try:
            rotation = str(_setting(cfg, "context_parallel_rotation", "ring"))
            check_context_parallel(model, block_size, rotation, cp, tp)
        except ValueError as error:
            raise ConfigError(f"cp={cp}: {error}") from None
    vocab, data_vocab = embedding_rows(model), cfg.data.get("vocab_size")
    trained = cfg.data.get("tokenizer_path") is None  # else the tokenizer's own size counts (`check_tokenizer`)
    if trained and isinstance(vocab, int) and isinstance(data_vocab, int) and data_vocab > vocab:
        raise ConfigError(
            f"data.vocab_size={data_vocab} exceeds the model's vocabulary of {vocab} tokens; "
            f"use data.vocab_size<={vocab} or a model with a larger vocabulary"
        )
    context = context_length(model)
    if context is not None and block_size is not None and block_size > context:
        raise ConfigError(
            f"data.block_size={block_size} exceeds the model's context of {context} tokens; "
            f"use data.block_size<={context} or a model with a longer context"
        )
    sequence_parallel = _setting(cfg, "sequence_parallel")
    if sequence_parallel and isinstance(block_size, int) and block_size % tp:
        raise ConfigError(
            f"sequence_parallel=true splits each sequence across tp={tp} ranks, but data.block_size={block_size} "
            f"is not a multiple of {tp}; use data.block_size={block_size - block_size % tp or tp} "
            f"or sequence_parallel=false"
        )
    samples = cfg.get("samples")
    if cp > 1 and samples and samples.get("prompts"):
        raise ConfigError(
            f"samples.prompts={list(samples.prompts)} with cp={cp}: samples are drawn one token at a time, which "
            f"cannot be split across context-parallel ranks; use samples.prompts=[] or cp=1"
        )
    if sequence_parallel and tp > 1 and samples and samples.get("prompts"):
        raise ConfigError(
            f"samples.prompts={list(samples.prompts)} with sequence_parallel=true: samples are drawn one token at a "
            f"time, which cannot be split along the sequence across tp={tp} ranks; use samples.prompts=[] or "
            f"sequence_parallel=false"
        )


def check_tokenizer(cfg: DictConfig, tokenizer_size: int, tokenizer_source: str, model: torch.nn.Module) -> None:
    """Every id of the tokenizer the data module uses has a row in the model's embedding (`model` may be on the meta
    device): a larger vocabulary is one line, before any rank starts."""
    rows = embedding_rows(model)
    if isinstance(rows, int) and tokenizer_size > rows:
        where = f"model.path={cfg.model.path}" if cfg.model.get("path") else f"model={type(model).__name__}"
        raise ConfigError(
            f"data.tokenizer_path={tokenizer_source} has {tokenizer_size} tokens, more than the {rows} rows of the "
            f"model's embedding ({where}); use the model's own tokenizer, or a model with a larger vocabulary"
        )


def embedding_rows(model: torch.nn.Module) -> int | None:
    """How many token ids `model`'s input embedding holds (its config's vocab_size where it has no embedding)."""
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    if isinstance(embedding, nn.Embedding):
        return embedding.num_embeddings
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    return vocab if isinstance(vocab, int) else None


def _check_one_batch(cfg: DictConfig, model: torch.nn.Module) -> None:
    """A Hugging Face model built from its family's config (`model.type`) runs one batch on one device: on the meta
    device (shapes only), in fp32 or else in bf16 (Hugging Face's grouped-GEMM experts refuse fp32 there; xLSTM's
    kernel mixes its fp32 states with bf16 inputs), before any rank starts or any sharding; `model` is left in bf16.
    It runs as a training step does, without a generation cache; where the meta device stops that early
    (DeepSeek-V3's attention reads a value), the family's default path, whose cache checks the heads' shapes, runs
    too. An error about the meta device itself, or there about the cache a training step never builds (Bamba's tiny
    layers, all linear attention), proves nothing and passes. A model that runs in neither dtype is refused with its
    bf16 error."""
    if not _from_family(cfg):
        return  # a saved model ran as it was saved; a model of your own may need other inputs
    block = cfg.data.get("block_size") or 8
    batch = torch.zeros(2, block, dtype=torch.long, device="meta")
    error = None
    for dtype in (torch.float32, torch.bfloat16):
        error = _one_batch_error(model.to(dtype), batch)
        if error is None:
            break
    model.to(torch.bfloat16)
    if error is not None:
        raise _family_refusal(cfg, f"run one batch of (2, {block}) tokens on one device", error)


def _one_batch_error(model: torch.nn.Module, batch: torch.Tensor) -> Exception | None:
    """The error that shows `model` cannot run `batch` on the meta device (`_check_one_batch`), or None."""
    default_path = lambda model, batch: model(batch)  # noqa: E731
    for forward, inconclusive in ((run_without_cache, ("meta",)), (default_path, ("meta", "cache"))):
        error = _meta_error(forward, model, batch)
        if error is None:
            return None
        reason = " ".join(str(error).split())
        proves_nothing = any(word in reason.lower() for word in inconclusive) or _building_a_cache(error)
        if not isinstance(error, NotImplementedError) and not proves_nothing:
            return error
    return None


def _from_family(cfg: DictConfig) -> bool:
    """Whether the model is a Hugging Face family built from its config (`model.type`), not a saved one."""
    return cfg.model.get("path") is None and cfg.model.get("type") is not None


def _family_refusal(cfg: DictConfig, failed: str, error: Exception) -> ConfigError:
    """One line for a model built from `model.type` that cannot be built or run: the family, the fields given, the
    error, and the fields it needs: those `model.config` sets otherwise than the family's small config (what
    `model.type` alone builds), or else those its config leaves None though they take an int (Dots1's expert
    counts before its small config set them)."""
    model_type = cfg.model.type
    config, family = (_plain(cfg.model.get(key)) for key in ("config", "family_fields"))
    needs = []
    differing = [
        f"{field}={small} (model.config: {given})" for field, (given, small) in departures(model_type, config).items()
    ]
    if differing:
        needs.append(f"its small config (model.type={model_type} alone) sets {', '.join(differing)}")
    unset = [] if differing else unset_fields(model_type, {**family, **config})  # a hint where nothing else is
    if unset:
        needs.append(f"its config leaves {', '.join(unset)} unset (None): set them (+model.config.{unset[0]}=...)")
    fields = ", ".join(f"{key}={value}" for key, value in config.items())
    reason = " ".join(str(error).split())
    return ConfigError(
        f"model.type={model_type} cannot {failed} with model.config {fields}: {type(error).__name__}: {reason[:200]}; "
        f"{'; '.join(needs) or 'change those fields'} (the zoo's tiny config for the family runs: python -m "
        f"tp_train.tools.zoo --families {model_type})"
    )


def _plain(node) -> dict:
    """A config node as a dict, resolved (a resolver's dict is one already; None is {})."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node or {})


def _building_a_cache(error: Exception) -> bool:
    """Whether `error` was raised while a generation cache was built (a constructor in transformers' cache_utils):
    BLT's cache reads `num_hidden_layers`, which its config keeps in sub-configs only; a training step builds none.
    DeepSeek-V3's heads, refused by the cache's update, are not this."""
    frames = traceback.extract_tb(error.__traceback__)
    return any(frame.filename.endswith("cache_utils.py") and frame.name == "__init__" for frame in frames)


def _meta_error(forward, model: nn.Module, batch: torch.Tensor) -> Exception | None:
    """What `forward(model, batch)` raises under no_grad, or None."""
    try:
        with torch.no_grad():
            forward(model, batch)
    except Exception as error:  # noqa: BLE001 - whatever the family's forward raises is the reason
        return error
    return None


def config_dims(cfg: DictConfig) -> ParallelDims | None:
    """The degrees `cfg` asks for (tp, cp, pp, ep, data_parallel, dp_shard, the strategy's virtual stages) at its
    trainer.devices x trainer.num_nodes ranks, not yet validated; None while trainer.devices is not a number.
    Raises ValueError for dp_shard without data_parallel=fsdp."""
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if not isinstance(devices, int) or not isinstance(nodes, int):
        return None
    return ParallelDims.from_world(
        ParallelDims.ranks_of(devices, nodes), tp=cfg.tp, cp=cfg.get("cp", 1), pp=cfg.get("pp", 1), ep=cfg.get("ep", 1),
        data_parallel=str(_setting(cfg, "data_parallel", "ddp")),
        virtual_stages=_setting(cfg, "pipeline_virtual_stages", 1),
        dp_shard=_setting(cfg, "data_parallel_shard_size", key="dp_shard"),
    )  # fmt: skip


def _check_numerics(cfg: DictConfig, dims: ParallelDims | None) -> None:
    """numerics=invariant's reach so far, before any rank starts: tensor parallelism alone, fp32 or fp64, without
    sequence parallelism or compile (ValueError, one line)."""
    numerics = str(_setting(cfg, "numerics", "fast"))
    if check_numerics(numerics, "numerics") != INVARIANT:
        return
    if dims is not None:
        check_invariant_dims(dims, numerics, str(_setting(cfg, "data_parallel", "ddp")))
    precision = lightning_precision(cfg.precision)
    if precision not in ("32-true", "64-true", "bf16-mixed"):
        raise ValueError(f"numerics=invariant runs precision=32, 64 or bf16 so far, not precision={cfg.precision}")
    for name in ("sequence_parallel", "compile"):
        if _setting(cfg, name, False):
            raise ValueError(f"numerics=invariant does not cover {name}=true yet; leave it off, or use numerics=fast")
    accumulated = cfg.trainer.get("accumulate_grad_batches", 1)
    if accumulated != 1:
        raise ValueError(
            f"numerics=invariant sums a batch's leaves in one tree: trainer.accumulate_grad_batches={accumulated} "
            f"would add the batches' sums in turn; use a larger data.batch_size"
        )
    if precision == "16-mixed":
        raise ValueError("numerics=invariant runs without a gradient scaler: use precision=bf16, 32 or 64")
    batch = cfg.data.get("batch_size")
    if dims is not None and isinstance(batch, int) and batch * dims.dp % LEAVES:
        raise ValueError(
            f"numerics=invariant cuts the global batch (data.batch_size={batch} x dp={dims.dp}) into {LEAVES} leaves "
            f"of samples; use a global batch that is a multiple of {LEAVES}"
        )


def layout_label(cfg: DictConfig) -> str:
    """The degrees and modes a memory estimate is for, e.g. "tp=2, pp=2 (the pipeline rank holding the most),
    hsdp: shard groups of 2 x 2 replicas, precision=32"."""
    cp = f", cp={cfg.cp}" if cfg.get("cp", 1) > 1 else ""
    pp = f", pp={cfg.pp} (the pipeline rank holding the most)" if cfg.get("pp", 1) > 1 else ""
    dims = config_dims(cfg)
    mode = str(_setting(cfg, "data_parallel", "ddp"))
    if dims is not None and dims.data_parallel == "hsdp":
        mode = f"hsdp: shard groups of {dims.dp_shard} x {dims.dp_replicate} replicas"
    return f"tp={cfg.tp}{cp}{pp}, {mode}, precision={cfg.precision}"


def _setting(cfg: DictConfig, name: str, default=None, key: str | None = None):
    """`name` as the strategy gets it: set on the strategy (`trainer.strategy.<name>`), else the top-level key
    (`key`, where its name differs: `dp_shard` for `data_parallel_shard_size`)."""
    strategy = cfg.get("trainer", {}).get("strategy") or {}
    value = strategy.get(name) if hasattr(strategy, "get") else None
    return value if value is not None else cfg.get(key or name, default)


def _check_data_source(data: DictConfig) -> None:
    source = str(data.get("source", ""))
    looks_local = (
        source.startswith((".", "/", "~"))
        or any(char in source for char in "*?[")
        or source.endswith((".txt", ".json", ".jsonl", ".md", ".py"))
    )  # otherwise a hub name such as "owner/name", which the data module checks
    if source == "python_stdlib" or not looks_local:
        return  # the stdlib, or a hub name (the data module reports an unreachable hub)
    if not glob.glob(os.path.expanduser(source)):
        raise ConfigError(
            f"data.source={source}: no such file or directory, or no files match it; "
            f"use a local file, directory or glob, or data.source=python_stdlib"
        )


def check_checkpoint(path: str | None, trust_checkpoint: bool = False) -> None:
    """The checkpoint's files are there, whole and data only (unless `trust_checkpoint`); whether they fit the model
    is checked by the ranks, on load."""
    if path is None or str(path) in ("auto", "last", "best", "hpc") or str(path).startswith("registry"):
        return  # found later: by tp_train.app.resume (auto, then checked again), or by Lightning
    path = os.path.expanduser(str(path))
    try:
        if os.path.isfile(path):  # one consolidated file (save_distributed_checkpoint=false), memory-mapped
            consolidated.read(Path(path), trust_checkpoint)
        else:
            check_files(path, trust_checkpoint)
    except UnsafeCheckpointError as error:  # it says what would work
        raise ConfigError(f"ckpt_path: {error}") from None
    except CheckpointError as error:
        raise ConfigError(
            f"ckpt_path: {error}; use a checkpoint directory a run saved, e.g. <run dir>/checkpoints/last.ckpt"
        ) from None


def _check_pretrained(model: DictConfig) -> None:
    """A `model.path` holds safetensors weights (what `load_pretrained` and `from_pretrained` here read)."""
    path = model.get("path") if hasattr(model, "get") else None
    if path is None or not os.path.isdir(os.path.expanduser(str(path))):
        return  # no pretrained weights, or the model's own check names a missing directory
    try:
        weight_files(path)
    except FileNotFoundError as error:
        raise ConfigError(f"model.path={path}: {error}") from None


def _check_fault_handling(cfg: DictConfig) -> None:
    action = cfg.get("nonfinite", "stop")
    if action not in ACTIONS:
        raise ConfigError(
            f"nonfinite={action}: use nonfinite=stop (end the run at a NaN/inf loss or gradient) or nonfinite=skip"
        )
    timeout = cfg.get("collective_timeout_s", 1)
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ConfigError(f"collective_timeout_s={timeout}: use a positive number of seconds, e.g. 1800")


def context_length(model: torch.nn.Module) -> int | None:
    """The longest sequence `model` takes (its config's block_size, max_position_embeddings or n_positions)."""
    config = getattr(model, "config", None)
    values = (getattr(config, field, None) for field in ("block_size", "max_position_embeddings", "n_positions"))
    return next((value for value in values if isinstance(value, int)), None)


def meta_model(cfg: DictConfig, build_model: Callable[[], Callable[[], nn.Module]]) -> nn.Module:
    """The model `build_model()()` builds on the meta device (shapes only), with the config's adapters (`peft`)."""
    with torch.device("meta"):
        model = build_model()()
        if cfg.get("peft"):  # only the adapters have gradients and optimizer states
            from peft import get_peft_model

            model = get_peft_model(model, instantiate(cfg.peft))
    return model


def estimate_for_config(cfg: DictConfig, build_model: Callable[[], Callable[[], nn.Module]]) -> MemoryEstimate:
    """`estimate_memory` for a training config (conf/train.yaml): the model `build_model()()` builds on the meta
    device, `data.batch_size` x `data.block_size` micro-batches, `tp`, `cp`, `pp` and its schedule, the data-parallel
    size the trainer's devices leave, `precision`, `data_parallel`, and `sequence_parallel` /
    `activation_checkpointing` / `loss_parallel` (top level or on the strategy)."""
    model = meta_model(cfg, build_model)
    dims = config_dims(cfg)
    cp, pp = cfg.get("cp", 1), cfg.get("pp", 1)
    dp = dims.dp if dims is not None else cfg.get("dp", 1)
    return estimate_memory(
        model,
        micro_batch_size=cfg.data.batch_size,
        seq_len=cfg.data.block_size,
        tp=cfg.tp,
        dp=dp,
        cp=cp,
        precision=lightning_precision(cfg.precision),
        sequence_parallel=bool(_setting(cfg, "sequence_parallel")),
        activation_checkpointing=bool(_setting(cfg, "activation_checkpointing")),
        data_parallel=str(_setting(cfg, "data_parallel", "ddp")),
        loss_parallel=bool(_setting(cfg, "loss_parallel")),
        pp=pp,
        pipeline_schedule=str(_setting(cfg, "pipeline_schedule", "1f1b")),
        pipeline_microbatches=_setting(cfg, "pipeline_microbatches"),
        pipeline_virtual_stages=int(_setting(cfg, "pipeline_virtual_stages", 1)),
        dp_shard=dims.dp_shard if dims is not None and dims.data_parallel == "hsdp" else None,
    )
