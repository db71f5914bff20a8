"""Single-device model code. Nothing here imports tp_train; sharding plans are data (`tp_plan`)."""

from models.gpt import GPT, GPTConfig, KVCache
from models.hf import hugging_face_causal_lm
from models.moe import MoEConfig, MoEGPT

__all__ = ["GPT", "GPTConfig", "KVCache", "MoEConfig", "MoEGPT", "hugging_face_causal_lm"]
