"""Config vocabulary for the training app: precision as users type it, and the resolvers `conf/` uses."""

from __future__ import annotations

from omegaconf import OmegaConf

# What users type -> Lightning's precision name. Lightning's own names map to themselves.
PRECISIONS = {
    "32": "32-true",
    "16": "16-mixed",
    "bf16": "bf16-mixed",
    "64": "64-true",
    "32-true": "32-true",
    "16-mixed": "16-mixed",
    "bf16-mixed": "bf16-mixed",
    "16-true": "16-true",
    "bf16-true": "bf16-true",
    "64-true": "64-true",
}


def lightning_precision(value: object) -> str:
    """Lightning's name for a precision written as `32`, `16`, `bf16`, `bf16-true`, ... (raises ValueError)."""
    name = str(value).strip().lower()
    if name not in PRECISIONS:
        raise ValueError(
            f"precision={value} is not a precision; use one of 32, 16, bf16, bf16-true, 16-true, 64 "
            f"(or Lightning's names 32-true, 16-mixed, bf16-mixed)"
        )
    return PRECISIONS[name]


def register_resolvers() -> None:
    """`${mul:a,b}` (devices = tp x dp) and `${precision:16}` for the configs in conf/."""
    if not OmegaConf.has_resolver("mul"):
        OmegaConf.register_new_resolver("mul", lambda a, b: int(a) * int(b))
    if not OmegaConf.has_resolver("precision"):
        OmegaConf.register_new_resolver("precision", lightning_precision)
