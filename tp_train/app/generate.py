"""`tp-train-generate CHECKPOINT --tp N --prompt TEXT`: text from a training run's checkpoint, on N ranks.

    tp-train-generate outputs/<run>/checkpoints/last.ckpt --tp 2 --prompt "def " --max-new-tokens 32
    tp-train-generate CKPT --tp 4 --prompt "import" --temperature 0.8 --top-k 50 --seed 1

The model is rebuilt from the run's own config (`<run>/.hydra/config.yaml`: the model, and its adapters with
`peft`), sharded at `--tp` (any tp: the checkpoint reshards as it loads; gloo CPU ranks, or NCCL with one GPU per rank)
and loaded with `tp_train.load_checkpoint`. The tokenizer is the one the run used (the checkpoint names it), or
`--tokenizer`. Tokens are drawn one at a time with a KV cache: each rank caches only its own heads' keys and values
(the sharded attention computes no others), so the cache is split like the model. Greedy decoding by default
(`--temperature 0`), otherwise sampling with temperature and top-k from a generator seeded alike on every rank, so
every rank draws the same token. Rank 0 prints the continuation (not the prompt), as the last line on stdout, and
the speed on stderr; `--no-cache` recomputes the whole prefix at every token instead, to measure what the cache
saves.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from tp_train.app.module import CausalLMModule
from tp_train.app.resolvers import register_resolvers
from tp_train.checkpoint.dcp import META_FILE, TOKENIZER_KEY, load
from tp_train.checkpoint.safe_load import read_extra
from tp_train.errors import CheckpointError, ConfigError
from tp_train.plan.parallelize import parallelize
from tp_train.tools.bench.ranks import start_ranks

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
    with torch.device("meta"):
        model = instantiate(cfg.model)()
        if cfg.get("peft"):
            from peft import get_peft_model

            model = get_peft_model(model, instantiate(cfg.peft))
    return model


def load_sharded(checkpoint: Path, group, mesh, device: torch.device) -> tuple[nn.Module, dict]:
    """The run's model sharded over `group` (its tp) with the checkpoint's weights, and the checkpoint's metadata."""
    model = parallelize(build_model(run_config(checkpoint)), group, device=device, verify=False)
    module = CausalLMModule(model=model, optimizer=None)  # what the checkpoint's keys ("model.…") are relative to
    extra = load(checkpoint, module, [], mesh)
    return model.eval(), extra


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
):
    """`max_new_tokens` token ids continuing `ids` (1, T), and the KV cache they were drawn with (None without).

    The model is `models.GPT` (its `KVCache`) or a Hugging Face causal LM (its own cache), sharded or not; its logits
    are whole (a sharded head gathers them). Greedy when `temperature` is 0, else sampled from the `top_k` most likely
    tokens at that temperature with `generator` (the same seed on every rank draws the same token)."""
    cache, tokens = None, ids
    for _ in range(max_new_tokens):
        if use_cache:
            logits, cache = _step(model, tokens if cache is None else tokens[:, -1:], cache, start=cache is None)
        else:
            logits, _ = _step(model, tokens, None, start=True)
        tokens = torch.cat([tokens, _pick(logits[:, -1].float(), temperature, top_k, generator)], dim=1)
    return tokens[:, ids.shape[1] :], cache


def _step(model: nn.Module, ids: torch.Tensor, cache, start: bool):
    """Logits of `ids` (continuing what `cache` holds) and the cache, for our GPT or a Hugging Face model."""
    if "cache" in inspect.signature(type(model).forward).parameters:  # models.GPT
        from models import KVCache

        cache = KVCache() if start else cache
        return model(ids, cache=cache), cache
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    return out.logits, out.past_key_values


def _pick(logits: torch.Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None):
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


def load_tokenizer(path: str):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    return AutoTokenizer.from_pretrained(path) if Path(path).is_dir() else PreTrainedTokenizerFast(tokenizer_file=path)


def _tokenizer_path(args: argparse.Namespace) -> str:
    if args.tokenizer:
        return args.tokenizer
    extra = read_extra(args.checkpoint / META_FILE) if (args.checkpoint / META_FILE).is_file() else {}
    if TOKENIZER_KEY not in extra:
        raise ConfigError(f"checkpoint {args.checkpoint} names no tokenizer (saved by an older run); pass --tokenizer")
    return extra[TOKENIZER_KEY]


def _rank(rank: int, world_size: int, device: torch.device, args: argparse.Namespace, tokenizer_path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size,))
    model, _ = load_sharded(args.checkpoint, mesh, mesh, device)
    tokenizer = load_tokenizer(tokenizer_path)
    ids = torch.tensor([tokenizer.encode(args.prompt, add_special_tokens=False)], device=device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    dist.barrier()
    start = time.perf_counter()
    new, _ = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, generator, not args.no_cache)
    seconds = time.perf_counter() - start
    if rank == 0:
        how = "recomputing the prefix" if args.no_cache else "with the KV cache"
        rate = new.shape[1] / seconds
        print(
            f"{new.shape[1]} tokens in {seconds:.2f} s ({rate:.1f} tokens/s, tp={world_size}, {how})", file=sys.stderr
        )
        print(tokenizer.decode(new[0].tolist()), flush=True)


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
        if args.tp < 1 or args.max_new_tokens < 1:
            raise ConfigError(f"--tp={args.tp} and --max-new-tokens={args.max_new_tokens} must be positive")
        tokenizer_path = _tokenizer_path(args)
        if not load_tokenizer(tokenizer_path).encode(args.prompt, add_special_tokens=False):
            raise ConfigError(f"--prompt={args.prompt!r} gives no tokens; give some text to continue")
        run_config(args.checkpoint)  # there, before any rank starts
    except (ConfigError, CheckpointError, OSError) as error:  # one line, status 2
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    start_ranks(_rank, args.tp, args, tokenizer_path)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
