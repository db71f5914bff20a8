"""`tp-train-plan`: the layouts of a cluster, planned from a laptop. The same chooser as `python train.py
parallel=auto` (`tp_train.tools.choose`) for a world of devices this machine does not have, on fake ranks in one
process; a deep model simulated from shallow builds of it (`tp_train.tools.depth`).

    tp-train-plan --model path/to/config.json --devices 64 --hardware h100-80gb --seq-len 8192 \\
        --global-batch-tokens 4M

`--model` is a Hugging Face `config.json` (or the directory holding one), or a model config of this repository's
`conf/model` (`gpt_small`; `hf` with `model.type=qwen2`-style overrides after it). Token counts take K, M and G
(binary: 4M is 4,194,304 tokens, 512 sequences of 8192).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

from tp_train.app.auto_layout import AUTOCAST, TRUE_DTYPES
from tp_train.tools.choose import HEADROOM, choose_layout, size_label, table
from tp_train.tools.depth import Depth
from tp_train.tools.hardware import GIB, GPU_PROFILES, profile_named

CONF = Path(__file__).resolve().parents[2] / "conf"  # the repository's configs, beside the package
DEPTH_FIELDS = ("num_hidden_layers", "n_layer")  # where a config gives its count of repeated blocks
PER_LAYER_FIELDS = ("layer_types",)  # config lists with one entry per block, cut with the depth
SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30}


def token_count(text: str) -> int:
    """`4M` -> 4,194,304; `8192` -> 8192 (K, M, G binary); a ValueError naming the value otherwise."""
    text = text.strip()
    scale = SUFFIXES.get(text[-1:].upper(), 1)
    number = text[:-1] if scale > 1 else text
    if not number.isdigit() or int(number) < 1:
        raise ValueError(f"--global-batch-tokens={text}: give a positive count of tokens, e.g. 4M or 524288")
    return int(number) * scale


def hugging_face_depth(path: str, dtype: torch.dtype) -> tuple[Depth, int]:
    """The model a Hugging Face `config.json` (or its directory) describes, buildable at any depth; its vocabulary."""
    from transformers import AutoConfig, AutoModelForCausalLM

    file = Path(path).expanduser()
    file = file / "config.json" if file.is_dir() else file
    if not file.is_file():
        raise ValueError(f"--model={path}: no such config.json; give a Hugging Face config.json, its directory, or a "
                         f"model config of conf/model ({', '.join(_conf_names())})")  # fmt: skip
    fields = json.loads(file.read_text())
    if "model_type" not in fields:
        raise ValueError(f"--model={path}: the config has no model_type; give a Hugging Face config.json")
    config = AutoConfig.for_model(**fields)
    field = next((name for name in DEPTH_FIELDS if hasattr(config, name)), None)
    if field is None:
        raise ValueError(f"--model={path}: no block count in the config (one of {', '.join(DEPTH_FIELDS)})")

    def build(blocks: int):
        shallow = copy.deepcopy(config)
        setattr(shallow, field, blocks)
        for name in PER_LAYER_FIELDS:
            if isinstance(getattr(shallow, name, None), list):
                setattr(shallow, name, getattr(shallow, name)[:blocks])
        return AutoModelForCausalLM.from_config(shallow, dtype=dtype)

    return Depth(build, getattr(config, field), f"{config.model_type}'s {field}"), config.vocab_size


def conf_depth(name: str, overrides: list[str], seq_len: int, dtype: torch.dtype) -> tuple[Depth, int]:
    """A model config of `conf/model` (with Hydra overrides), buildable at any depth, and its vocabulary."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate
    from omegaconf import open_dict

    from tp_train.app.resolvers import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={name}", f"data.block_size={seq_len}", *overrides])
    fields = cfg.model.config
    field = next((key for key in DEPTH_FIELDS if key in fields), None)
    if field is None:
        raise ValueError(f"--model={name}: no block count in model.config (one of {', '.join(DEPTH_FIELDS)})")
    blocks = int(fields[field])
    vocab = int(fields.get("vocab_size") or cfg.data.vocab_size)

    def build(count: int):
        shallow = copy.deepcopy(cfg.model)
        with open_dict(shallow):
            shallow.config[field] = count
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return instantiate(shallow)()
        finally:
            torch.set_default_dtype(default)

    return Depth(build, blocks, f"model.config.{field}"), vocab


def _conf_names() -> list[str]:
    return sorted(path.stem for path in (CONF / "model").glob("*.yaml"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tp-train-plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Hugging Face config.json (or its directory), or conf/model's")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of a conf/model model (model.config.n_layer=24)")
    parser.add_argument("--devices", type=int, required=True, help="devices in all")
    parser.add_argument("--devices-per-node", type=int, default=8)
    parser.add_argument("--hardware", required=True, help=f"a profile: {', '.join(GPU_PROFILES)}, cpu-2core")
    parser.add_argument("--memory-per-device", type=float, help="GiB a device holds (default: the profile's)")
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--global-batch-tokens", required=True, help="tokens per optimizer step: 4M, 524288")
    parser.add_argument("--precision", default="bf16-mixed", choices=[*AUTOCAST, *TRUE_DTYPES, "32-true"])
    for degree in ("tp", "pp", "dp", "dp-shard"):
        parser.add_argument(f"--{degree}", type=int, help=f"pin {degree}")
    parser.add_argument("--data-parallel", choices=["ddp", "fsdp"], help="pin the data-parallel mode")
    parser.add_argument("--rows", type=int, default=5, help="layouts printed in full")
    return parser


def plan(argv: list[str] | None = None) -> str:
    """The table `tp-train-plan` prints (a ValueError, one line, for bad input)."""
    args = _parser().parse_args(argv)
    profile = profile_named(args.hardware)
    if args.devices < 1 or args.devices_per_node < 1 or args.devices % min(args.devices, args.devices_per_node):
        raise ValueError(
            f"--devices={args.devices} --devices-per-node={args.devices_per_node}: give a whole number of nodes "
            f"(devices a multiple of devices per node)"
        )
    nodes = max(1, args.devices // args.devices_per_node)
    tokens = token_count(args.global_batch_tokens)
    if args.seq_len < 1 or tokens % args.seq_len:
        raise ValueError(
            f"--global-batch-tokens={args.global_batch_tokens} ({tokens} tokens) is not a whole number of "
            f"--seq-len={args.seq_len} sequences; give a multiple of {args.seq_len}"
        )
    dtype = TRUE_DTYPES.get(args.precision, torch.float32)  # the weights' (mixed precision keeps them in fp32)
    if Path(args.model).expanduser().exists() or args.model.endswith(".json"):
        depth, vocab = hugging_face_depth(args.model, dtype)
    elif args.model in _conf_names():
        depth, vocab = conf_depth(args.model, args.overrides, args.seq_len, dtype)
    else:
        raise ValueError(
            f"--model={args.model}: neither a config.json nor a model of conf/model; give a path or one of "
            f"{', '.join(_conf_names())}"
        )
    pinned = {key: getattr(args, key) for key in ("tp", "pp", "dp", "dp_shard") if getattr(args, key) is not None}
    if args.data_parallel:
        pinned["data_parallel"] = args.data_parallel
    memory = args.memory_per_device * GIB if args.memory_per_device else float(profile.memory_bytes)
    started = time.perf_counter()
    candidates = choose_layout(
        depth, args.devices, tokens // args.seq_len, args.seq_len, vocab, memory, profile, pinned,
        autocast=AUTOCAST.get(args.precision), num_nodes=nodes,
    )  # fmt: skip
    seconds = time.perf_counter() - started
    usable = size_label(memory * (1 - HEADROOM))
    title = (
        f"tp-train-plan: {args.devices} devices ({nodes} node{'s' * (nodes > 1)}), {usable} usable each, "
        f"{profile.name}; {depth.blocks} blocks, {tokens // args.seq_len} x {args.seq_len} tokens a step "
        f"({len(candidates)} layouts simulated in {seconds:.0f} s)"
    )
    if not candidates[0].fits:
        best = candidates[0]
        need = best.unshardable or f"the smallest, {best.layout.label()}, needs {size_label(best.memory)}"
        title += f"\nno layout fits: {need}; give more devices, --memory-per-device, or a smaller global batch"
    return f"{title}\n{table(candidates, memory, args.rows)}"


def main(argv: list[str] | None = None) -> None:
    try:
        print(plan(argv))
    except ValueError as error:
        print(f"tp-train-plan: {str(error).splitlines()[0]}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
