"""The probe's input: what the auto-planner, verification and the region check run a model on, given or made up from
what the model is (docs/planner.md, "The probe input")."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

PROBE_TOKENS = 8
IMAGE_CHANNELS = 3  # a vision config without `num_channels`
AUDIO_SAMPLES_PER_TOKEN = 400  # raw `input_values`: samples per probe token (25 ms at 16 kHz)


@dataclass(frozen=True)
class ProbeInput:
    """A forward's arguments: positional `args` and keyword `kwargs`."""

    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    @classmethod
    def of(cls, example) -> ProbeInput:
        """`example` as a forward's arguments: a tensor is the one positional argument, a tuple or list the
        positional arguments, a dict the keyword arguments (Lightning's `example_input_array` convention)."""
        if isinstance(example, ProbeInput):
            return example
        if isinstance(example, torch.Tensor):
            return cls((example,))
        if isinstance(example, (tuple, list)):
            return cls(tuple(example))
        if isinstance(example, dict):
            return cls((), dict(example))
        raise TypeError(
            f"example_input={type(example).__name__}: pass a tensor, a tuple of positional arguments or a dict of "
            f"keyword arguments for the model's forward"
        )

    def tensors(self) -> list[torch.Tensor]:
        return [value for value in (*self.args, *self.kwargs.values()) if isinstance(value, torch.Tensor)]

    def map(self, function) -> ProbeInput:
        """Each tensor argument through `function`; other arguments as they are."""

        def each(value):
            return function(value) if isinstance(value, torch.Tensor) else value

        return ProbeInput(tuple(each(value) for value in self.args), {k: each(v) for k, v in self.kwargs.items()})

    def to(self, device: torch.device) -> ProbeInput:
        return self.map(lambda tensor: tensor.to(device))

    def doubled(self) -> ProbeInput:
        """Every batch-major tensor twice along the batch (two copies of each example: code that folds the batch
        into another dimension, as per-head biases built per sequence do, then shows)."""
        return self.map(lambda tensor: torch.cat([tensor, tensor]) if tensor.dim() else tensor)

    def describe(self, model: nn.Module | None = None) -> str:
        """`input_ids (1, 8), pixel_values (1, 3, 32, 32)`: what the probe passed, positional arguments named as
        `model`'s forward names them, for messages."""
        names = list(forward_parameters(model)) if model is not None else []
        positional = [names[index] if index < len(names) else f"argument {index}" for index in range(len(self.args))]
        named = list(zip(positional, self.args, strict=True)) + list(self.kwargs.items())
        return ", ".join(f"{name} {_shape(value)}" for name, value in named)

    def __call__(self, model: nn.Module):
        """`model(*args, **kwargs)` without a generation cache (`run_without_cache`)."""
        return run_without_cache(model, *self.args, **self.kwargs)


def run_without_cache(model: nn.Module, *args, **kwargs):
    """`model(*args, **kwargs)`, with `use_cache=False` where its forward takes `use_cache` and `kwargs` do not set
    it (Hugging Face models): a probe or a training step wants the dataflow, not a generation cache, and some
    models' default cache cannot be built from their layers (the decoder of BART or Pegasus used as a causal LM, a
    hybrid whose layers are all linear attention: Bamba's and Bailing-hybrid's tiny two layers)."""
    if "use_cache" in forward_parameters(model):
        kwargs.setdefault("use_cache", False)
    return model(*args, **kwargs)


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else type(value).__name__


def forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters of `model.forward` by name ({} for a forward without a signature Python can read)."""
    try:
        return dict(inspect.signature(getattr(model, "forward", model)).parameters)
    except (TypeError, ValueError):
        return {}


def probe_input(model: nn.Module, example=None, length: int = PROBE_TOKENS, batch: int = 1) -> ProbeInput:
    """`example` as a `ProbeInput` on the model's device, or, without one, the model's own (`dummy_batch` for a
    Hugging Face model, else `batch` x `length` token ids); see the module docstring."""
    if example is not None:
        return ProbeInput.of(example).to(_device(model))
    made = dummy_batch(model, length, batch)
    return made if made is not None else ProbeInput((probe_token_ids(model, length, batch),))


def probe_token_ids(model: nn.Module, length: int = PROBE_TOKENS, batch: int = 1, seed: int = 0) -> torch.Tensor:
    """(batch, length) random token ids (drawn with `seed`) that every embedding of `model` accepts."""
    embeddings = [module for module in model.modules() if isinstance(module, nn.Embedding)]
    vocabulary = getattr(getattr(model, "config", None), "vocab_size", None)  # I-BERT's embeddings are its own
    if not embeddings and not isinstance(vocabulary, int):
        raise ValueError(
            f"the auto-planner needs an example input for {forward_argument(model)} (it has no nn.Embedding to draw "
            f"token ids for): {EXAMPLE_INPUT_HINT}"
        )
    high = min(module.num_embeddings for module in embeddings) if embeddings else vocabulary
    return torch.randint(0, high, (batch, length), generator=torch.Generator().manual_seed(seed)).to(_device(model))


def forward_argument(model: nn.Module) -> str:
    """`ViTModel's forward argument `pixel_values``: the model and its forward's first argument, for messages."""
    argument = next(iter(forward_parameters(model)), "")
    return f"{type(model).__name__}'s forward argument `{argument}`" if argument else type(model).__name__


EXAMPLE_INPUT_HINT = (
    "pass example_input=... (a tensor, a tuple of positional or a dict of keyword arguments), set the "
    "LightningModule's example_input_array, or give the model a `tp_plan`"
)


def dummy_batch(model: nn.Module, length: int = PROBE_TOKENS, batch: int = 1, seed: int = 0) -> ProbeInput | None:
    """A Hugging Face model's probe batch (random values drawn with `seed`), shaped by its config: its
    `main_input_name` and the other inputs its forward requires (BLIP-2's retrieval takes images and text),
    `decoder_input_ids` for an encoder-decoder, and a contrastive dual encoder's (CLIP's) token ids with its pixel
    values; None for a model that is not a Hugging Face model, or needs an input not made here."""
    config, main = getattr(model, "config", None), getattr(model, "main_input_name", None)
    parameters = forward_parameters(model)
    if config is None or not isinstance(main, str) or main not in parameters:
        return None
    required = [name for name, parameter in parameters.items() if parameter.default is inspect.Parameter.empty]
    names = [main, *(name for name in required if name in MADE and name != main)]
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in parameters:
        names.append("decoder_input_ids")
    if "return_loss" in parameters:  # a contrastive dual encoder (CLIP, SigLIP, ALIGN): text and images
        names += [name for name in ("input_ids", "pixel_values") if name in parameters]
    if "pixel_values" in names and "spatial_shapes" in parameters:  # NaFlex patches: their mask and grid too
        names += ["pixel_attention_mask", "spatial_shapes"]
    made = {}
    for name in dict.fromkeys(names):
        value = _dummy(model, config, name, length, batch, seed + len(made))
        if value is None:
            return None
        made[name] = value.to(_device(model))
    return ProbeInput((), made)


# The inputs made up, beside a model's main input when its forward requires them.
MADE = ("input_ids", "decoder_input_ids", "pixel_values", "pixel_values_videos", "input_features", "input_values",
        "pixel_attention_mask", "spatial_shapes")  # fmt: skip
DEFAULT_IMAGE_SIZE = 64  # a vision config without `image_size` (convolutional networks)


def _dummy(model: nn.Module, config, name: str, length: int, batch: int, seed: int) -> torch.Tensor | None:
    generator = torch.Generator().manual_seed(seed)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if name == "inputs":  # Perceiver's (and a speech encoder-decoder's) generic input: as the model reads it
        name = _generic_input(model, config)
    if name in ("input_ids", "decoder_input_ids"):
        return probe_token_ids(model, length, batch, seed)
    naflex = _holding(config, "num_patches") if "spatial_shapes" in forward_parameters(model) else None
    if name in ("pixel_values", "pixel_values_videos") and naflex is not None:  # SigLIP 2's: images cut into patches
        width = (getattr(naflex, "num_channels", None) or IMAGE_CHANNELS) * naflex.patch_size**2
        return torch.randn(batch, naflex.num_patches, width, generator=generator, dtype=dtype)
    if name in ("pixel_attention_mask", "spatial_shapes"):
        patches = _holding(config, "num_patches").num_patches
        if name == "pixel_attention_mask":
            return torch.ones(batch, patches, dtype=torch.long)
        return torch.tensor([[math.isqrt(patches), patches // math.isqrt(patches)]] * batch)
    if name in ("pixel_values", "pixel_values_videos"):
        vision = _holding(config, "image_size") or _holding(config, "num_channels") or config
        size = getattr(vision, "image_size", None) or DEFAULT_IMAGE_SIZE
        height, width = (size, size) if isinstance(size, int) else (int(size[0]), int(size[-1]))
        channels = getattr(vision, "num_channels", None) or IMAGE_CHANNELS
        frames = (getattr(vision, "num_frames", None) or 1,) if name == "pixel_values_videos" else ()
        return torch.randn(batch, *frames, channels, height, width, generator=generator, dtype=dtype)
    if name == "input_features":
        shape = _feature_shape(config, length)
        return None if shape is None else torch.randn(batch, *shape, generator=generator, dtype=dtype)
    if name == "input_values":
        return torch.randn(batch, length * AUDIO_SAMPLES_PER_TOKEN, generator=generator, dtype=dtype)
    return None


def _generic_input(model: nn.Module, config) -> str:
    """What a forward taking `inputs` reads: token ids where an embedding has the vocabulary's rows (Perceiver's
    masked LM), else images or audio as the config describes."""
    vocabulary = getattr(config, "vocab_size", None)
    if any(isinstance(module, nn.Embedding) and module.num_embeddings == vocabulary for module in model.modules()):
        return "input_ids"
    if _holding(config, "image_size"):
        return "pixel_values"
    if _feature_shape(config, PROBE_TOKENS) is not None:  # spectrogram features
        return "input_features"
    return "input_values" if _holding(config, "conv_dim") or _holding(config, "sampling_rate") else "input_ids"


def _feature_shape(config, length: int) -> tuple[int, int] | None:
    """Audio features past the batch: Whisper's (mel bins, 2 x max_source_positions: its two convolutions halve the
    frames to exactly the positions it has), Speech2Text's (frames, features x channels), else (frames, mel bins or
    the feature projection's input width, SeamlessM4T's)."""
    audio = next(
        (found for field in ("num_mel_bins", "input_feat_per_channel", "feature_projection_input_dim")
         if (found := _holding(config, field)) is not None),
        None,
    )  # fmt: skip
    if audio is None:
        return None
    positions = getattr(audio, "max_source_positions", None)
    if getattr(audio, "num_mel_bins", None) and isinstance(positions, int):
        return audio.num_mel_bins, 2 * positions
    if getattr(audio, "input_feat_per_channel", None):
        return 4 * length, audio.input_feat_per_channel * getattr(audio, "input_channels", 1)
    return 4 * length, getattr(audio, "num_mel_bins", None) or audio.feature_projection_input_dim


def _holding(config, field_name: str):
    """`config`, or the first of its sub-configs (vision, audio, encoder), that has `field_name` set."""
    subs = ("vision_config", "audio_config", "speech_config", "encoder_config", "encoder")
    owners = [config, *(getattr(config, sub, None) for sub in subs)]
    return next((owner for owner in owners if getattr(owner, field_name, None) is not None), None)


def _device(model: nn.Module) -> torch.device:
    return next((param.device for param in model.parameters()), torch.device("cpu"))
