"""Single-device model code. Nothing here imports tp_train; sharding plans are data (`tp_plan`)."""

from models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
