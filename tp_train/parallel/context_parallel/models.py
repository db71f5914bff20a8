"""Context parallelism plugged into models: each rank of a context-parallel group runs the model on its share of every
sequence and attention spans the group (docs/long-sequences.md); attentions the kernel cannot split exactly are
refused in one line naming the module."""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from tp_train.parallel.context_parallel import (
    check_heads,
    context_parallel_attention,
    document_ids_from_separators,
    positions_within_documents,
    shard_sequence,
)
from tp_train.parallel.context_parallel.load_balance import check_sequence_length
from tp_train.parallel.widening import statistics_dtype, widened

HF_ATTENTION = "tp_train_context_parallel"
# Where a module or config keeps its number of query heads (the plan reads the same names: `plan.styles`).
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "n_head", "n_heads")
_POSITION_ARGUMENTS = ("position_ids", "positions")  # Hugging Face's name, then our GPT's
_INPUT_ARGUMENTS = ("input_ids", "idx")


class ContextParallelState:
    """What one forward's attention kernels need beyond q, k, v: the group, and this rank's document ids."""

    def __init__(self, group: ProcessGroup, rotation: str, document_separator: int | None):
        self.group, self.rotation, self.document_separator = group, rotation, document_separator
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.document_ids: torch.Tensor | None = None  # (B, T / cp), set by the pre-hook before each forward

    def attention(self, q, k, v, *, where: str, scale=None, causal=True, window=None):
        """This rank's share of attention over the whole sequence, refusing what would not be exact."""
        total = q.shape[2] * self.size
        if not causal:
            raise ValueError(f"{where}: non-causal (cross- or bidirectional) attention cannot be context-parallel")
        if window is not None and window < total:
            raise ValueError(
                f"{where}: sliding window {window} < sequence length {total} is not handled by context parallelism; "
                f"use cp=1 or sequences of at most {window} tokens"
            )
        if self.rotation == "alltoall":
            check_heads(q.shape[1], self.size, where)
        return context_parallel_attention(
            q, k, v, self.group, causal=True, document_ids=self.document_ids, scale=scale, rotation=self.rotation
        )


def enable_context_parallel(
    model: nn.Module, cp_group: ProcessGroup, rotation: str = "ring", document_separator: int | None = None
) -> nn.Module:
    """Makes `model` (token ids -> logits) run context-parallel over `cp_group`, in place: keys and values reach each
    rank by `rotation` ("ring" or "allgather"), or "alltoall" trades every rank's tokens for a share of the heads;
    `document_separator`, the end-of-text id between packed documents, makes attention block-diagonal by document."""
    state = ContextParallelState(cp_group, rotation, document_separator)
    target, position_argument = _positioned_model(model)
    kernels = _swap_attention_kernels(model, state)
    if not kernels:
        raise ValueError(
            f"{type(model).__name__}: found no attention to make context-parallel (our GPT's CausalSelfAttention "
            f"or a Hugging Face model with an attention implementation)"
        )
    target.register_forward_pre_hook(_sharding_hook(state, position_argument), with_kwargs=True)
    model.tp_context_parallel = state
    return model


def shard_targets(targets: torch.Tensor, state: ContextParallelState) -> torch.Tensor:
    """This rank's share of (B, T) labels, already shifted against the inputs, in the order of its tokens."""
    return shard_sequence(targets, state.size, state.rank, dim=1)


def mean_over_group(local_mean: torch.Tensor, local_count: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The mean over every token of the group's ranks, from each rank's mean over its `local_count` tokens.

    Its value is the global mean on every rank; its gradient is cp x (this rank's share of the global mean's), so
    that averaging gradients over the group (as DDP over dp x cp does) gives the global mean's gradient exactly,
    whatever number of ignored labels each rank holds."""
    count = local_count.detach().to(statistics_dtype(local_mean.dtype))
    local_sum = torch.where(count > 0, widened(local_mean) * count, torch.zeros_like(count))
    totals = torch.stack([local_sum.detach(), count])
    dist.all_reduce(totals, group=group)
    total_count = totals[1].clamp(min=1)
    for_gradient = local_sum * dist.get_world_size(group) / total_count
    return for_gradient + (totals[0] / total_count - for_gradient).detach()


def context_parallel_cross_entropy(
    loss_fn, logits: torch.Tensor, target: torch.Tensor, root: nn.Module, ignore_index: int = -100, *args
) -> torch.Tensor:
    """The mean of `loss_fn(logits, targets, ignore_index, *args)` (a mean over non-ignored tokens) over every
    token of the sequence, from this rank's logits (B, T / cp, vocab) and the whole sequence's labels (B, T)."""
    state = next((m.tp_context_parallel for m in root.modules() if hasattr(m, "tp_context_parallel")), None)
    if state is None:
        raise RuntimeError(f"{type(root).__name__}: no context-parallel model inside (parallelize(cp_group=...))")
    local_targets = shard_targets(target, state)
    local = loss_fn(logits, local_targets, ignore_index, *args)
    return mean_over_group(local, (local_targets != ignore_index).sum(), state.group)


def _positioned_model(model: nn.Module) -> tuple[nn.Module, str]:
    """The outermost module (model or a submodule) whose forward takes token ids and position ids."""
    for module in model.modules():
        parameters = inspect.signature(module.forward).parameters
        if any(name in parameters for name in _INPUT_ARGUMENTS):
            found = next((name for name in _POSITION_ARGUMENTS if name in parameters), None)
            if found is not None:
                return module, found
    raise ValueError(
        f"{type(model).__name__}: context parallelism needs a forward taking token ids and position ids "
        f"({' or '.join(_POSITION_ARGUMENTS)}), so each rank's tokens keep their global positions"
    )


def _sharding_hook(state: ContextParallelState, position_argument: str):
    def hook(module, args, kwargs):
        if state.size == 1 and any(kwargs.get(name) is not None for name in ("cache", "past_key_values")):
            state.document_ids = None
            return None  # one rank generating with a cache: plain attention, the model's own positions
        if kwargs.get("attention_mask") is not None:
            raise ValueError(
                f"{type(module).__name__}: an attention mask given to the model cannot be context-parallel; "
                f"pack sequences without padding (a document mask comes from document_separator)"
            )
        if kwargs.get(position_argument) is not None:
            raise ValueError(f"{type(module).__name__}: {position_argument} are set by context parallelism")
        name = next((n for n in _INPUT_ARGUMENTS if n in kwargs), None)
        tokens = args[0] if args else kwargs[name]
        batch, length = tokens.shape
        if state.size > 1:
            check_sequence_length(length, state.size)
        if state.document_separator is not None:
            documents = document_ids_from_separators(tokens, state.document_separator)
            positions = positions_within_documents(documents)
            state.document_ids = shard_sequence(documents, state.size, state.rank, dim=1)
        else:
            positions = torch.arange(length, device=tokens.device).expand(batch, length)
            state.document_ids = None
        local = shard_sequence(tokens, state.size, state.rank, dim=1)
        kwargs = dict(kwargs, **{position_argument: shard_sequence(positions, state.size, state.rank, dim=1)})
        if args:
            return (local, *args[1:]), kwargs
        return args, dict(kwargs, **{name: local})

    return hook


def _swap_attention_kernels(model: nn.Module, state: ContextParallelState) -> int:
    """Points every attention of `model` at the context-parallel kernel; returns how many it found."""
    found = 0
    for name, module in model.named_modules():
        if hasattr(module, "sdpa") and callable(module.sdpa):  # our GPT's seam
            module.sdpa = _sdpa_kernel(state, name)
            found += 1
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation") and hasattr(module, "set_attn_implementation"):
            _refuse_unsplittable_config(module)
            _register_hf_attention()
            for part in module.modules():  # the kernel is handed only the attention module: each carries the group
                part.__dict__[_HF_STATE] = state
            module.set_attn_implementation(HF_ATTENTION)
            found += 1
            break
    return found


def _sdpa_kernel(state: ContextParallelState, where: str):
    """A function with SDPA's signature running the context-parallel kernel, for our GPT's `sdpa` seam."""

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if state.size == 1 and state.document_ids is None:  # one rank, one document (e.g. generating)
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )  # fmt: skip
        if attn_mask is not None or dropout_p:
            raise ValueError(f"{where}: an attention mask or attention dropout cannot be context-parallel")
        return state.attention(q, k, v, where=where, scale=scale, causal=is_causal)

    return sdpa


_HF_STATE = "_tp_train_context_parallel"  # the attribute (outside nn.Module's registries) holding a module's state


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Transformers' attention-function signature: (B, H, T, D) in, ((B, T, H, D), None) out."""
    where = type(module).__name__
    state = module.__dict__.get(_HF_STATE)
    if state is None:
        raise RuntimeError(f"{where}: no context-parallel group recorded for this model")
    for key_name, reason in (("softcap", "score soft-cap"), ("s_aux", "attention sinks"), ("position_bias", "ALiBi")):
        if kwargs.get(key_name) is not None:
            raise ValueError(f"{where}: {reason} is not handled by context parallelism; use cp=1")
    if dropout and module.training:
        raise ValueError(f"{where}: attention dropout {dropout} cannot be context-parallel; set it to 0")
    causal = getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    out = state.attention(query, key, value, where=where, scale=scaling, causal=causal, window=window)
    return out.transpose(1, 2).contiguous(), None


def _register_hf_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)
    # no mask: the context-parallel kernel masks by position and document itself
    AttentionMaskInterface.register(HF_ATTENTION, lambda *args, **kwargs: None)


def check_context_parallel(
    model: nn.Module, sequence_length: int | None = None, rotation: str = "ring", cp: int = 1, tp: int = 1
) -> None:
    """Raises a one-line `ValueError` for what `model` (built on meta is enough) shows context parallelism cannot
    split exactly: run before any rank starts. Our GPT with dropout, a Hugging Face config with a score soft-cap,
    ALiBi, cross-attention, attention dropout, or a sliding window shorter than `sequence_length`; with the
    "alltoall" `rotation`, query heads per tensor-parallel rank that do not divide by `cp`."""
    config = getattr(model, "config", None)
    for field in HEAD_ATTRIBUTES if rotation == "alltoall" and cp > 1 else ():
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp == 0:  # a count tp does not divide is the plan's refusal
            check_heads(heads // tp, cp, where=f"config.{field}={heads} at tp={tp}")
    for name, module in model.named_modules():
        if hasattr(module, "sdpa") and getattr(module, "dropout", 0):
            raise ValueError(f"{name}: attention dropout {module.dropout} cannot be context-parallel; set it to 0")
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation") and hasattr(module, "set_attn_implementation"):
            _refuse_unsplittable_config(module, sequence_length)
            return


def _refuse_unsplittable_config(model: nn.Module, sequence_length: int | None = None) -> None:
    """One line before any step for what the config alone shows the kernel cannot do exactly."""
    config = model.config
    kind = getattr(config, "model_type", type(model).__name__)
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and sequence_length is not None and window < sequence_length:
        raise ValueError(
            f"{kind}: config.sliding_window={window} < sequence length {sequence_length} is not handled by context "
            f"parallelism; use cp=1 or sequences of at most {window} tokens"
        )
    if getattr(config, "attention_dropout", 0):
        raise ValueError(f"{kind}: config.attention_dropout={config.attention_dropout} cannot be context-parallel")
    for field, reason in (
        ("attn_logit_softcapping", "a score soft-cap"),
        ("alibi", "ALiBi position biases"),
        ("is_encoder_decoder", "cross-attention"),
    ):
        if getattr(config, field, None):
            raise ValueError(f"{kind} ({type(model).__name__}): config.{field} means {reason}, not context-parallel")
    if getattr(config, "position_embedding_type", "rope") == "alibi":
        raise ValueError(f"{kind}: ALiBi position biases are not handled by context parallelism")
