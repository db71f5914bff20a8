"""`python train.py parallel=auto trainer.devices=4 global_batch_size=16`: the degrees chosen for the run
(`tp_train.tools.choose`), from its model and data config, and written into the config before anything is built.

A degree given on the command line (`tp=2`, `pp=1`, `dp=2`, `dp_shard=2`, `data_parallel=fsdp`) pins it; the others
are chosen, with activation checkpointing, the pipeline's schedule and microbatches, and how each data-parallel rank's
share of `global_batch_size` is cut (`data.batch_size` sequences at once, `trainer.accumulate_grad_batches` of them).
`memory_per_device` (GiB) and `hardware` (a profile of `tp_train.tools.hardware`) describe a target other than this
machine. The launching process chooses and passes the choice to the ranks it starts in their environment, so every
rank trains the same layout.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import traceback

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf, open_dict

from tp_train.app.preflight import meta_model
from tp_train.app.resolvers import lightning_precision
from tp_train.errors import ConfigError
from tp_train.parallel.dims import ParallelDims
from tp_train.tools.choose import DEGREES, HEADROOM, choose_layout, size_label, table
from tp_train.tools.hardware import CPU_HERE, GIB, PROFILES, profile_named
from tp_train.tools.memory import MIB
from tp_train.training.apply_order import TrainingOptions

AUTO = "auto"
CHOSEN_ENVIRONMENT_VARIABLE = "TP_TRAIN_AUTO_LAYOUT"  # the launching process's choice, for the ranks it starts
PINNABLE = (*DEGREES, "data_parallel")
NOT_CHOSEN = ("cp", "ep")  # kept at their defaults under auto (tp_train.tools.choose's docstring)
AUTOCAST = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16, "64-true": torch.float64}


def apply_auto_layout(cfg: DictConfig, command_line: list[str], rank: int) -> str | None:
    """Under `parallel=auto`, chooses the layout (on the launching process; the ranks it starts read its choice),
    writes it into `cfg` and returns the table of candidates (None elsewhere, and on a started rank)."""
    mode = cfg.get("parallel", "manual")
    if mode not in ("manual", AUTO):
        raise ConfigError(f"parallel={mode}: use parallel=manual (the degrees as given) or parallel=auto")
    if mode != AUTO:
        return None
    passed = os.environ.get(CHOSEN_ENVIRONMENT_VARIABLE)
    if passed is not None:
        _write(cfg, json.loads(passed))
        return None
    chosen, report = _choose(cfg, _pinned(command_line))
    _write(cfg, chosen)
    if rank == 0:
        os.environ[CHOSEN_ENVIRONMENT_VARIABLE] = json.dumps(chosen)
    return report


def _in_a_child(fn, *args, **kwargs):
    """`fn(*args, **kwargs)` in a forked child process, its result or its ValueError (as a ConfigError) passed back:
    the simulation sets up fake process groups, meshes and fake tensors, and none of what they leave may reach the
    process that then trains (with it, the launching rank's first FSDP2 gather while loading a checkpoint waited
    forever for its peers; what state did it is not pinned down). The child runs on the CPU only: whatever needs the
    GPU (the hardware profile, its memory) is read before, in this process."""
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)

    def child() -> None:
        try:
            sending.send((True, fn(*args, **kwargs)))
        except ValueError as error:
            sending.send((False, f"parallel=auto: {error}"))
        except BaseException as error:  # noqa: BLE001 - passed back, with its traceback, to be raised there
            sending.send((None, "".join(traceback.format_exception(error))))

    process = context.Process(target=child, daemon=True)
    process.start()
    sending.close()
    try:
        ok, result = receiving.recv()
    except EOFError:
        process.join()
        ok, result = None, f"the process choosing the layout ended with status {process.exitcode} and no answer"
    process.join()
    if ok is None:
        raise RuntimeError(f"parallel=auto: choosing the layout failed:\n{result}")
    if not ok:
        raise ConfigError(result)
    return result


def _pinned(command_line: list[str]) -> dict:
    """The degrees the command line gives a number (or a mode) to: `tp=2`, `+dp=2`, `data_parallel=fsdp`."""
    pinned = {}
    for override in command_line:
        key, _, value = override.lstrip("+~").partition("=")
        if key in PINNABLE and value != AUTO:
            pinned[key] = value if key == "data_parallel" else _positive(key, value)
    return pinned


def _check_not_chosen(cfg: DictConfig) -> None:
    """The degrees the chooser keeps at their defaults must be there, wherever the config set them."""
    for key in NOT_CHOSEN:
        value = cfg.get(key)
        if value not in (None, 1):
            raise ConfigError(
                f"{key}={value} with parallel=auto: the chooser does not simulate {key} yet; leave {key} at its "
                f"default, or use parallel=manual"
            )


def _positive(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{key}={value}: pin a positive number with parallel=auto (e.g. {key}=2), or leave it unset")
    return int(value)


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _world_size(cfg: DictConfig) -> tuple[int, int]:
    """(The ranks to fill, the nodes they are on)."""
    devices, nodes = cfg.trainer.get("devices"), cfg.trainer.get("num_nodes", 1)
    if OmegaConf.is_interpolation(cfg.trainer, "devices") or not _count(devices):
        given = "" if OmegaConf.is_interpolation(cfg.trainer, "devices") else f" (trainer.devices={devices})"
        raise ConfigError(
            f"parallel=auto needs the world to fill{given}: give trainer.devices=N (devices per node, a number) and, "
            f"across nodes, trainer.num_nodes=M"
        )
    return ParallelDims.ranks_of(devices, nodes), nodes


def _memory_per_device(cfg: DictConfig, devices_per_node: int, profile) -> float:
    given = cfg.get("memory_per_device")
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or given <= 0:
            raise ConfigError(f"memory_per_device={given}: give each device's memory in GiB, e.g. memory_per_device=80")
        return float(given) * GIB
    if cfg.get("hardware") is not None:  # a target other than this machine: its devices' memory
        return float(profile.memory_bytes)
    if torch.cuda.is_available():
        return float(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices_per_node  # a node's ranks share its RAM


def _profile(cfg: DictConfig):
    name = cfg.get("hardware")
    if name is None:
        return CPU_HERE if not torch.cuda.is_available() else _gpu_profile()
    try:
        return profile_named(str(name))
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _gpu_profile():
    device = torch.cuda.get_device_name(0)
    for key, family in (("H200", "h200-141gb"), ("H100", "h100-80gb"), ("A100", "a100-80gb")):
        if key in device:
            return PROFILES[family]
    raise ConfigError(f"parallel=auto: no hardware profile for {device}; give hardware=<{' | '.join(PROFILES)}>")


def _choose(cfg: DictConfig, pinned: dict) -> tuple[dict, str]:
    global_batch = cfg.get("global_batch_size")
    if not _count(global_batch):
        given = "" if global_batch is None else f" (global_batch_size={global_batch})"
        raise ConfigError(
            f"parallel=auto holds the global batch fixed{given}: give global_batch_size=N, a positive number of "
            f"sequences per optimizer step"
        )
    _check_not_chosen(cfg)
    world_size, nodes = _world_size(cfg)
    profile = _profile(cfg)
    memory = _memory_per_device(cfg, cfg.trainer.devices, profile)
    try:
        precision = lightning_precision(cfg.precision)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    model = meta_model(cfg, lambda: instantiate(cfg.model))
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or cfg.data.vocab_size

    def build():
        # Made in the precision's dtype, as Lightning's true-precision plugins make it (a default dtype while the
        # model is built): converting a fake model afterwards cannot swap a Hugging Face model's tied embedding.
        default = torch.get_default_dtype()
        torch.set_default_dtype(TRUE_DTYPES.get(precision, default))
        try:
            return instantiate(cfg.model)()
        finally:
            torch.set_default_dtype(default)

    strategy = cfg.trainer.get("strategy") or {}
    options = TrainingOptions(
        loss_parallel=bool(strategy.get("loss_parallel", True)),
        sequence_parallel=bool(cfg.get("sequence_parallel", False)),
    )
    if cfg.get("dp_shard") is not None:  # set in the config: pinned as if given on the command line
        pinned.setdefault("dp_shard", cfg.dp_shard)
    candidates = _in_a_child(
        choose_layout, build, world_size, global_batch, cfg.data.block_size, vocab, memory, profile, pinned, options,
        AUTOCAST.get(precision), num_nodes=nodes,
    )  # fmt: skip
    best = candidates[0]
    if not best.fits:
        smallest = (
            f"none can shard it ({best.unshardable})"
            if best.unshardable
            else (f"the smallest, {best.layout.label()}, needs {size_label(best.memory)}")
        )
        raise ConfigError(
            f"parallel=auto: no layout of {world_size} ranks fits {size_label(memory * (1 - HEADROOM))} a device "
            f"({size_label(memory)} less {HEADROOM:.0%} headroom); {smallest}; give more devices, memory_per_device, "
            f"or a smaller global_batch_size"
        )
    layout = best.layout
    chosen = {
        "tp": layout.dims.tp, "pp": layout.dims.pp, "dp": layout.dims.dp_per_node(nodes),
        "dp_shard": layout.dims.dp_shard if layout.dims.data_parallel == "hsdp" else None,
        "data_parallel": layout.options.data_parallel,
        "activation_checkpointing": layout.options.activation_checkpointing,
        "batch_size": layout.micro_batch, "accumulate_grad_batches": layout.accumulation,
        "pipeline_schedule": layout.options.pipeline_schedule,
        "pipeline_microbatches": layout.options.pipeline_microbatches,
        "pipeline_virtual_stages": layout.dims.virtual_stages,
        "label": layout.label(), "memory_mib": round(best.memory / MIB, 1),
        "predicted_tokens_per_s": round(best.tokens_per_s, 1),
    }  # fmt: skip
    title = f"parallel=auto: {world_size} ranks, {memory / GIB:.2f} GiB each, {profile.name}; chose {layout.label()}"
    return chosen, f"{title}\n{table(candidates, memory)}"


def _write(cfg: DictConfig, chosen: dict) -> None:
    """The chosen layout into the config, where the strategy, the data and the trainer read each part."""
    with open_dict(cfg):
        cfg.tp, cfg.pp, cfg.dp = chosen["tp"], chosen["pp"], chosen["dp"]
        cfg.dp_shard = chosen.get("dp_shard")  # HSDP's shard group; None: all of dp (FSDP2), or DDP
        cfg.data_parallel, cfg.activation_checkpointing = chosen["data_parallel"], chosen["activation_checkpointing"]
        cfg.data.batch_size = chosen["batch_size"]
        if "whole_steps" in cfg.data:  # every step the same global batch, on this layout and any it resumes on
            cfg.data.whole_steps = True
        cfg.trainer.accumulate_grad_batches = chosen["accumulate_grad_batches"]
        strategy = cfg.trainer.strategy
        strategy.pipeline_schedule = chosen["pipeline_schedule"]
        strategy.pipeline_microbatches = chosen["pipeline_microbatches"]
        strategy.pipeline_virtual_stages = chosen["pipeline_virtual_stages"]
        cfg.chosen_layout = {key: chosen[key] for key in ("label", "memory_mib", "predicted_tokens_per_s")}
