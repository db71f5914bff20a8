"""Built-in plans for Hugging Face families whose configs ship no `base_model_tp_plan`.

Keys are relative to the base model (as in Hugging Face's own plans); `preset_plan` prefixes them for a model
with a head and adds the head. Each preset is data; `tp_train.plan` is what reads it.
"""

from __future__ import annotations

import torch.nn as nn

PRESETS: dict[str, dict[str, str]] = {
    # GPT-2: c_attn is a fused [q; k; v] Conv1D, so its split must be head-aware; the attention module keeps
    # split_size / num_heads / embed_dim as attributes; resid_dropout acts on the replicated residual stream.
    "gpt2": {
        "wte": "embedding_rowwise",
        "h.*.attn": "attention",
        "h.*.attn.c_attn": "fused_qkv_colwise",
        "h.*.attn.c_proj": "rowwise",
        "h.*.attn.resid_dropout": "replicated_rng",
        "h.*.mlp.c_fc": "colwise",
        "h.*.mlp.c_proj": "rowwise",
    },
}

HEAD_PLAN = {"lm_head": "colwise_gather_output"}


def preset_plan(model: nn.Module) -> dict[str, str] | None:
    """The preset for `model.config.model_type`, with keys as `model`'s module names; None when there is none."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    base = PRESETS.get(model_type)
    if base is None:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    if prefix and hasattr(model, prefix):
        plan = {f"{prefix}.{pattern}": style for pattern, style in base.items()}
    else:
        plan = dict(base)
    if isinstance(getattr(model, "lm_head", None), nn.Linear):
        plan.update(HEAD_PLAN)
    return plan
