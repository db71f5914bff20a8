"""`tp-train-generate CHECKPOINT --tp N --prompt TEXT`: text from a training run's checkpoint, on N ranks."""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from tp_train.app.module import CausalLMModule
from tp_train.app.preflight import context_length, meta_model
from tp_train.app.resolvers import register_resolvers
from tp_train.checkpoint.checks import check_files
from tp_train.checkpoint.dcp import checkpoint_extra, load
from tp_train.errors import CheckpointError, ConfigError
from tp_train.parallel.dims import ParallelDims
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.ranks import start_ranks
from tp_train.tools.generation import Sampling, generate
from tp_train.tools.tokenizer import load_tokenizer, run_tokenizer

RUN_CONFIG = Path(".hydra", "config.yaml")  # in the run directory, beside checkpoints/


def run_config(checkpoint: Path) -> DictConfig:
    """The config of the run that saved `checkpoint` (`<run>/checkpoints/<name>`)."""
    path = checkpoint.resolve().parent.parent / RUN_CONFIG
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {checkpoint}: no {RUN_CONFIG} in its run directory ({path.parent.parent}) to rebuild the "
            f"model from; give a checkpoint a train.py run saved, in its run's checkpoints/ directory"
        )
    register_resolvers()
    return OmegaConf.load(path)


def build_model(cfg: DictConfig) -> nn.Module:
    """The run's model (its adapters too), unsharded, on the meta device: each rank materialises its shards."""
    return meta_model(cfg, lambda: instantiate(cfg.model))


def load_sharded(checkpoint: Path, group, mesh, device: torch.device) -> tuple[nn.Module, dict]:
    """The run's model sharded over `group` (its tp) with the checkpoint's weights, and the checkpoint's metadata."""
    model = parallelize(build_model(run_config(checkpoint)), group, device=device, verify=False)
    module = CausalLMModule(model=model, optimizer=None)  # what the checkpoint's keys ("model.…") are relative to
    extra = load(checkpoint, module, [], mesh)
    return model.eval(), extra


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, tokenizer_path: str) -> None:
    with contextlib.redirect_stdout(sys.stderr):  # stdout is the continuation's alone
        dims = ParallelDims.from_world(world_size, tp=world_size)
        dims.validate()
        mesh = dims.build_mesh(device.type)
        model, _ = load_sharded(args.checkpoint, mesh.tensor_parallel, mesh.root, device)
    tokenizer = load_tokenizer(tokenizer_path)
    ids = torch.tensor([tokenizer.encode(args.prompt, add_special_tokens=False)], device=device)
    sampling = Sampling(args.temperature, args.top_k, args.seed)
    dist.barrier()
    start = time.perf_counter()
    new, _ = generate(model, ids, args.max_new_tokens, sampling, tokenizer.eos_token_id, not args.no_cache)
    seconds = time.perf_counter() - start
    if rank == 0:
        how = "recomputing the prefix" if args.no_cache else "with the KV cache"
        rate = new.shape[1] / seconds
        print(
            f"{new.shape[1]} tokens in {seconds:.2f} s ({rate:.1f} tokens/s, tp={world_size}, {how})", file=sys.stderr
        )
        print(tokenizer.decode(new[0].tolist()), flush=True)


def _check(args: argparse.Namespace) -> str:
    """What can be checked before any rank starts (one `ConfigError` line each); returns the tokenizer's path."""
    if args.tp < 1 or args.max_new_tokens < 1:
        raise ConfigError(f"--tp={args.tp} and --max-new-tokens={args.max_new_tokens} must be positive")
    check_files(args.checkpoint)  # there, whole and data only
    cfg = run_config(args.checkpoint)
    tokenizer_path = args.tokenizer or run_tokenizer(args.checkpoint, checkpoint_extra(args.checkpoint))
    if tokenizer_path is None:
        raise ConfigError(f"checkpoint {args.checkpoint} names no tokenizer (saved by an older run); pass --tokenizer")
    prompt = load_tokenizer(tokenizer_path).encode(args.prompt, add_special_tokens=False)
    if not prompt:
        raise ConfigError(f"--prompt={args.prompt!r} gives no tokens; give some text to continue")
    context = context_length(build_model(cfg))
    if context is not None and len(prompt) + args.max_new_tokens > context:
        room = max(context - len(prompt), 0)
        raise ConfigError(
            f"--max-new-tokens={args.max_new_tokens}: the prompt's {len(prompt)} tokens and {args.max_new_tokens} new "
            f"ones exceed the model's context of {context} tokens; use --max-new-tokens<={room} or a shorter prompt"
        )
    return tokenizer_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tp-train-generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint of a train.py run (<run>/checkpoints/last.ckpt)")
    parser.add_argument("--tp", type=int, default=1, help="ranks to shard the model over (any tp)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", help="a tokenizer directory or tokenizer.json (default: the run's)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the whole prefix for every token")
    args = parser.parse_args(argv)
    try:
        tokenizer_path = _check(args)
    except (ConfigError, CheckpointError, OSError, ValueError) as error:  # one line, status 2
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        sys.exit(2)
    start_ranks(_rank, args.tp, args, tokenizer_path)


if __name__ == "__main__":
    main()
