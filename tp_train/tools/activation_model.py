"""The activation side of `tp_train.tools.memory`'s estimate: a model's shape read from its config, and what a
micro-batch holds for backward on one rank, in parts (`ActivationParts`) that a pipeline stage takes its share of."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tp_train.parallel.cross_entropy import CHUNK_BYTES
from tp_train.parallel.sharding import ceil_div

# Bytes per element of (parameters, activations) for each precision setting.
PRECISION_BYTES = {
    "64-true": (8, 8),
    "32-true": (4, 4),
    "16-mixed": (4, 2),
    "bf16-mixed": (4, 2),
    "16-true": (2, 2),
    "bf16-true": (2, 2),
}
MIXED_PRECISIONS = ("16-mixed", "bf16-mixed")  # autocast: fp32 parameters and residual stream, matmuls in half


def config_field(config, name: str):
    """`config.name`, None where it has none; a field Hugging Face keeps per layer (Gemma 4's `head_dim`) raises
    when read as one value, so its global value is read from the config's own attributes."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(name)


def model_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """(layers, hidden width, MLP width, vocabulary) from a GPTConfig or a Hugging Face config."""
    config = getattr(model, "config", None)

    def field(*names: str) -> int | None:
        return next((config_field(config, n) for n in names if isinstance(config_field(config, n), int)), None)

    layers = field("n_layer", "num_hidden_layers", "num_layers")
    hidden = field("n_embd", "hidden_size", "d_model")
    vocab = field("vocab_size")
    if None in (layers, hidden, vocab):
        raise ValueError(
            f"estimate_memory: cannot read the layer count, width and vocabulary of {type(model).__name__} from "
            f"model.config; it needs fields such as n_layer / n_embd / vocab_size"
        )
    mlp = field("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size") or 4 * hidden
    return layers, hidden, mlp, vocab


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) from a GPTConfig or a Hugging Face config."""
    config = getattr(model, "config", None)
    _, hidden, _, _ = model_shape(model)
    heads = next(
        (config_field(config, n) for n in ("n_head", "num_attention_heads", "num_heads") if config_field(config, n)), 1
    )
    kv_heads = config_field(config, "num_key_value_heads") or heads
    head_dim = config_field(config, "head_dim") or hidden // heads
    return heads, kv_heads, head_dim


@dataclass(frozen=True)
class ActivationParts:
    """What a micro-batch holds for backward on one rank, in parts (bytes, or elements from `activation_elements`),
    so that a pipeline stage can take its own blocks' share: each block's saved tensors, the block input kept under
    activation checkpointing, the residual stream's two ends, autocast's low-precision weight copies, the loss's
    tensors, and what the loss adds beyond them (its fp32 chunks)."""

    block: int
    kept: int
    ends: int
    weights: int
    loss: int
    extra: int = 0

    def total(
        self, layers: int, activation_checkpointing: bool = False, loss: bool = True, in_flight: float = 1
    ) -> int:
        """Held at the peak (the loss's forward) by `layers` blocks for `in_flight` micro-batches at once (a pipeline
        schedule's); without `loss`, by a pipeline stage before the last. Autocast's weight copies are made once."""
        own_loss, extra = (self.loss, self.extra) if loss else (0, 0)
        if activation_checkpointing:  # the recomputed block comes after the loss's backward has freed the logits
            kept = int(in_flight * (layers * self.kept + self.ends))
            return kept + self.weights + max(own_loss, self.block) + extra
        return int(in_flight * (layers * self.block + self.ends + own_loss)) + self.weights + extra


def _element_parts(
    model: nn.Module, micro_batch_size: int, seq_len: int, tp: int, sequence_parallel: bool, loss_parallel: bool
) -> ActivationParts:
    _, hidden, mlp, vocab = model_shape(model)
    tokens = micro_batch_size * seq_len
    replicated = tokens * hidden // (tp if sequence_parallel else 1)
    block = 4 * replicated + (4 * hidden + 2 * mlp) * tokens // tp
    loss = tokens * ceil_div(vocab, tp) if loss_parallel else 4 * tokens * vocab
    return ActivationParts(block=block, kept=replicated, ends=2 * replicated, weights=0, loss=loss)


def activation_elements(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    loss_parallel: bool = False,
) -> int:
    """Elements autograd keeps for one micro-batch's backward on one rank in one precision (see the module
    docstring), with `F.cross_entropy`'s four logits-sized tensors (or the vocabulary-parallel loss's one)."""
    layers = model_shape(model)[0]
    parts = _element_parts(model, micro_batch_size, seq_len, tp, sequence_parallel, loss_parallel)
    return parts.total(layers, activation_checkpointing)


def activation_parts(
    model: nn.Module,
    micro_batch_size: int,
    seq_len: int,
    tp: int = 1,
    precision: str = "32-true",
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    parameters: int = 0,
) -> ActivationParts:
    """What a micro-batch holds for backward on one rank, in parts, by precision (see `activation_bytes`);
    `parameters` are the elements on this rank whose autocast copies the matmuls save under mixed precision."""
    _, activation_width = PRECISION_BYTES[precision]
    _, hidden, mlp, vocab = model_shape(model)
    tokens = micro_batch_size * seq_len
    local_vocab = ceil_div(vocab, tp) if loss_parallel else vocab
    # fp32 chunks the loss holds at once: a copy of one and its exps (fp32 logits: the exps alone).
    copies = 1 if activation_width == 4 else 2
    chunks = copies * min(CHUNK_BYTES, tokens * local_vocab * 4) if loss_parallel else 0
    if precision not in MIXED_PRECISIONS:
        elements = _element_parts(model, micro_batch_size, seq_len, tp, sequence_parallel, loss_parallel)
        width = activation_width
        return ActivationParts(
            elements.block * width, elements.kept * width, elements.ends * width, 0, elements.loss * width, chunks
        )
    replicated = tokens * hidden // (tp if sequence_parallel else 1)
    block = 2 * replicated * 4 + (4 * tokens * hidden + (4 * hidden + 2 * mlp) * tokens // tp) * activation_width
    loss = tokens * local_vocab * activation_width + chunks if loss_parallel else 4 * tokens * vocab * 4
    return ActivationParts(
        block=block, kept=replicated * 4, ends=2 * replicated * 4, weights=parameters * activation_width, loss=loss
    )
