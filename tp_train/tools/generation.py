"""Text from a causal LM, sharded or not, one token at a time with a KV cache: the decoding loop that
`tp-train-generate` and a training run's validation samples share.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from tp_train.parallel.collectives import gather_from_tensor_parallel_region
from tp_train.plan.parallelize import attached


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits."""

    temperature: float = 0.0  # 0: greedy (the most likely token); else softmax(logits / temperature)
    top_k: int | None = None  # sample among the k most likely tokens only
    seed: int = 0  # the generator every rank seeds alike


@torch.no_grad()
def generate(
    model: nn.Module,
    ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    eos_token_id: int | None = None,
    use_cache: bool = True,
    group: ProcessGroup | None = None,
):
    """Up to `max_new_tokens` token ids (1, N) continuing `ids` (1, T), and the KV cache they were drawn with (None
    with `use_cache=False`, which runs the whole sequence through the model for every token instead).

    Args:
        model: `models.GPT` or a Hugging Face causal LM (or a peft model around one), sharded or not, in eval mode.
        ids: the prompt's token ids, one sequence.
        max_new_tokens: how many tokens to draw at most; drawing stops before `eos_token_id`.
        sampling: greedy by default; see `Sampling`.
        eos_token_id: the token that ends a document, not drawn into the continuation.
        use_cache: keep each attention's keys and values; False recomputes the whole prefix at every token.
        group: the model's tensor-parallel group (default: the world, when a process group exists).
    """
    generator = torch.Generator(device=ids.device).manual_seed(sampling.seed)
    cache, tokens = None, ids
    for _ in range(max_new_tokens):
        if use_cache:
            logits, cache = _forward(model, tokens if cache is None else tokens[:, -1:], cache)
        else:
            logits, _ = _forward(model, tokens, None, use_cache=False)
        token = _same_on_every_rank(_pick(_whole_logits(model, logits[:, -1:], group), sampling, generator), group)
        if token.item() == eos_token_id:
            break
        tokens = torch.cat([tokens, token.view(1, 1)], dim=1)
    return tokens[:, ids.shape[1] :], cache


def takes_kv_cache(model: nn.Module) -> bool:
    """Whether `model` takes our `cache=` argument (`models.GPT`), rather than Hugging Face's `past_key_values`."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # a peft model: its base
    return "cache" in inspect.signature(type(inner).forward).parameters


def _forward(model: nn.Module, ids: torch.Tensor, cache, use_cache: bool = True):
    """Logits of `ids`, continuing what `cache` holds, and the cache with their keys and values added."""
    if takes_kv_cache(model):
        if not use_cache:
            return model(ids), None
        from models import KVCache

        cache = KVCache() if cache is None else cache
        return model(ids, cache=cache), cache
    out = model(input_ids=ids, past_key_values=cache, use_cache=use_cache)
    return out.logits, out.past_key_values if use_cache else None


def _whole_logits(model: nn.Module, logits: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Logits over the whole vocabulary: a head sharded along it (`loss_parallel`) is gathered, its padding cut."""
    sizes = attached(model, "tp_vocab_size")
    if not sizes:
        return logits
    gathered = gather_from_tensor_parallel_region(logits, group if group is not None else dist.group.WORLD)
    return gathered[..., : sizes[0]]


def _pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> torch.Tensor:
    """The next token (a 0-d tensor) from the last position's logits (1, 1, vocab)."""
    logits = logits.reshape(-1).float()
    if sampling.temperature <= 0:
        return logits.argmax()
    logits = logits / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.numel():
        kth = logits.topk(sampling.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)[0]


def _same_on_every_rank(token: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """The group's first rank's token on every rank of the group (their logits agree; this makes sure of it)."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return token
    token = token.clone()
    dist.broadcast(token, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return token
