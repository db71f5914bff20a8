"""The zoo's tasks: which Hugging Face families each covers, how one is built from a tiny config, the batches it
trains on and its loss (`tp_train.tools.zoo`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

TOWERS = ("text", "vision")  # the sub-configs of a dual encoder whose towers the `towers` task builds
BATCH, LENGTH = 2, 16  # examples per batch and tokens per sequence
# Sizes of the parts a text-only tiny config leaves at full size, set wherever a (sub-)config has them (docs/zoo.md).
TASK_FIELDS = dict(image_size=32, patch_size=8, window_size=4, num_mel_bins=16, max_source_positions=16,
                   num_labels=10)  # fmt: skip
# Hierarchical vision models keep their sizes per stage, in lists of their own: the generic sizes are dropped (None).
STAGES = dict(hidden_size=None, num_hidden_layers=None, num_attention_heads=None, intermediate_size=None)
SWIN = dict(STAGES, embed_dim=32, depths=[2, 2], num_heads=[4, 8], window_size=4, patch_size=2)
# Every stage has heads that tp 2 and 4 divide (the families run at both).
PYRAMID = dict(STAGES, image_size=64, hidden_sizes=[16, 32, 64, 128], num_attention_heads=[4, 4, 4, 8])
# Parameters a family initialises to zeros that its checkpoints train, drawn as its other weights are (std 0.02).
TRAINED_ZEROS = {"blip-2": ("query_tokens",)}
# Fields a family needs beyond those (where its defaults disagree with the tiny sizes), by model type.
FAMILY_TASK_FIELDS: dict[str, dict] = {
    "mobilebert": dict(embedding_size=16, intra_bottleneck_size=16, num_feedforward_networks=1),
    "squeezebert": dict(embedding_size=32),  # its embedding must be as wide as its blocks
    "esm": dict(pad_token_id=1, mask_token_id=2),  # none by default: its embedding masks by them
    "neomme": dict(head_dim=16),  # M-RoPE rotates a quarter of a head, in multiples of 4
    "reformer": dict(is_decoder=False),  # its masked LM is bidirectional (the causal-LM zoo sets True)
    # a conv over each head's values shorter than the 16 tokens (its default 65 segfaults at tp 4: docs/zoo.md)
    "nystromformer": dict(conv_kernel_size=9),
    "perceiver": dict(
        d_model=32,
        d_latents=32,
        num_latents=16,
        num_self_attends_per_block=2,
        num_self_attention_heads=4,
        num_cross_attention_heads=4,
    ),  # fmt: skip
    "swin": SWIN,
    "donut-swin": SWIN,
    "swinv2": dict(SWIN, pretrained_window_sizes=[0, 0]),
    "pvt": dict(PYRAMID, sequence_reduction_ratios=[8, 4, 2, 1]),
    "pvt_v2": PYRAMID,
    "segformer": {key: value for key, value in PYRAMID.items() if key != "image_size"},
    "hiera": dict(
        STAGES, image_size=[64, 64], patch_size=[7, 7], embed_dim=32, num_heads=[4, 4, 8, 16], depths=[1] * 4
    ),
    # NaFlex patches: 16 of 8 x 8 pixels (a 4 x 4 grid)
    "siglip2": dict(vision_config=dict(num_patches=16)),
    # its Q-Former reads the vision tower's width and the text; the vision tower's default init is 1e-10, as BLIP's
    "blip-2": dict(
        qformer_config=dict(encoder_hidden_size=32, use_qformer_text_input=True),
        vision_config=dict(initializer_range=0.02),
    ),
    # images large enough that attention has more than one token to mix (docs/zoo.md)
    "mobilevit": dict(image_size=96, patch_size=2),
    "videoprism": dict(
        vision_config=dict(tubelet_size=[1, 8, 8], num_frames=4, num_spatial_layers=2, num_temporal_layers=2)
    ),  # fmt: skip
    # one head in its first stage by default (tp divides none), and full-size stages whose training diverges
    "cvt": dict(num_heads=[4, 4, 8], embed_dim=[32, 64, 128], depth=[1, 2, 3]),
    # local attention windows of 8 tokens (512 by default: the probe's tokens would be padded to 512)
    "led": dict(attention_window=[8, 8]),
    "longformer": dict(attention_window=8),
    "pegasus_x": dict(block_size=8, num_global_tokens=4),  # blocks of 512 tokens and 32 global ones by default
    # BLIP's vision tower initialises at 1e-10 by default, which at the tiny size blows gradients up to 1e9
    "blip": dict(vision_config=dict(initializer_range=0.02)),
    # images of 8 x 8 patches of 16 pixels: its last stage attends among 2 x 2 (with 1, its heads act alike)
    "levit": dict(
        STAGES,
        image_size=128,
        patch_size=16,
        hidden_sizes=[32, 64, 96],
        num_attention_heads=[4, 4, 4],
        key_dim=[8, 8, 8],
        depths=[1, 1, 1],
        down_ops=[["Subsample", 8, 4, 4, 2, 2], ["Subsample", 8, 8, 4, 2, 2]],
    ),  # fmt: skip
}


@dataclass(frozen=True)
class Task:
    name: str
    mapping: str  # the transformers mapping of model types it covers (`MODEL_FOR_MASKED_LM_MAPPING_NAMES`)
    auto_class: str  # the auto class that builds one (`AutoModelForMaskedLM`)


TASKS = {
    task.name: task
    for task in (
        Task("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
        Task("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
        Task("seq2seq-lm", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
        Task("speech-seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
        Task("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
        Task(
            "dual-encoder",
            "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            "AutoModelForZeroShotImageClassification",
        ),
        Task("towers", "MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModel"),
    )
}


def task_families(task: str = "causal-lm") -> list[str]:
    """The families the task covers, by model type (`towers`: `clip.text`, `clip.vision`, ...)."""
    from transformers.models.auto import modeling_auto

    names = sorted(getattr(modeling_auto, TASKS[task].mapping))
    return [f"{name}.{tower}" for name in names for tower in TOWERS] if task == "towers" else names


def build(task: str, family: str, config: dict):
    """The family's model for the task, randomly initialised from the current seed, from `config` (its tiny config,
    `tp_train.tools.zoo.tiny_config`; a tower's, its dual encoder's) with `TASK_FIELDS` and `FAMILY_TASK_FIELDS`
    (`tp_train.tools.zoo.build_family` passes it)."""
    import torch
    import transformers

    from models.hf import hugging_face_model

    if task == "towers":
        return _tower(*family.split("."), config)
    if task == "causal-lm":  # as the causal-LM zoo always built them: text sizes only
        return hugging_face_model(family, config, transformers.AutoModelForCausalLM)
    model = hugging_face_model(family, _without_none(task_config(family, config)), _model_class(task, family))
    for name in TRAINED_ZEROS.get(family, ()):
        torch.nn.init.normal_(getattr(model, name), std=0.02)
    return model


def _model_class(task: str, family: str):
    """The task's class for the family: its auto class, or the first class its mapping names where it names several
    (DeiT's classifier with and without a teacher, which the auto class cannot choose between from a config)."""
    import transformers
    from transformers.models.auto import modeling_auto

    named = getattr(modeling_auto, TASKS[task].mapping).get(family)
    return getattr(transformers, named[0] if isinstance(named, (tuple, list)) else TASKS[task].auto_class)


def _without_none(config: dict) -> dict:
    """`config` without the fields a family sets to None in `FAMILY_TASK_FIELDS` (generic sizes it keeps per stage,
    as lists of its own), in its sub-configs too."""
    return {key: _without_none(value) if isinstance(value, dict) else value
            for key, value in config.items() if value is not None}  # fmt: skip


def task_config(model_type: str, config: dict) -> dict:
    """`config` (a family's tiny config) with the task's sizes set in it and in every sub-config that has them."""
    from transformers import CONFIG_MAPPING

    config = dict(config)
    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports it
        return config
    config |= _sized(defaults)
    for field in getattr(type(defaults), "sub_configs", {}):
        sub = getattr(defaults, field, None)
        if isinstance(config.get(field), dict) and sub is not None:
            config[field] |= _sized(sub)
    return _merged(config, FAMILY_TASK_FIELDS.get(model_type, {}))


def _merged(config: dict, fields: dict) -> dict:
    """`config` with `fields` set, a sub-config's dict merged into the sub-config's."""
    merged = dict(config)
    for key, value in fields.items():
        both = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merged(merged[key], value) if both else value
    return merged


def _sized(defaults) -> dict:
    """The `TASK_FIELDS` this config has (`num_labels` is a property of every config, set through `id2label`)."""
    return {field: value for field, value in TASK_FIELDS.items() if field in vars(defaults) or field == "num_labels"}


def _tower(model_type: str, tower: str, config: dict):
    """A dual encoder's text or vision tower: the family's own tower class (`CLIPTextModel`, `SiglipVisionModel`)
    built from the tiny whole model's sub-config, or the auto class of the sub-config's type (BLIP-2's OPT)."""
    import transformers
    from transformers import PreTrainedModel

    whole = build("dual-encoder", model_type, config)
    config = getattr(whole.config, f"{tower}_config")
    module = sys.modules[type(whole).__module__]
    classes = [
        value
        for value in vars(module).values()
        if isinstance(value, type)
        and issubclass(value, PreTrainedModel)
        and value.config_class is type(config)
        and value.__name__.endswith("Model")
    ]
    if classes:
        return min(classes, key=lambda cls: len(cls.__name__))(config)
    return transformers.AutoModel.from_config(config)


def batches(task: str, model, steps: int) -> list[tuple]:
    """`steps` (inputs, loss) pairs: the inputs a `ProbeInput`, `loss(output)` a scalar."""
    import torch

    from tp_train.plan.probe_input import ProbeInput, dummy_batch

    pairs = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(1234 + step)
        if task == "causal-lm":
            vocabulary = model.config.get_text_config().vocab_size  # a multimodal LM keeps it in its text config
            idx = torch.randint(0, vocabulary, (BATCH, LENGTH), generator=generator)
            pairs.append((ProbeInput((idx,)), lambda output, idx=idx: _next_token_loss(output, idx)))
            continue
        inputs = dummy_batch(model, LENGTH, BATCH, seed=1234 + 10 * step)
        if inputs is None:
            raise ValueError(f"{type(model).__name__} takes no input the zoo can make up ({model.main_input_name})")
        pairs.append((inputs, lambda output, generator=generator: _random_target_loss(output, generator)))
    return pairs


def _next_token_loss(logits, idx):
    import torch.nn.functional as F

    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), idx[:, 1:].flatten())


def _random_target_loss(output, generator):
    """Cross-entropy of `output` (..., C) against targets drawn from `generator`: the same targets for the
    unsharded and the sharded model, as long as each draws them once per step in the same order."""
    import torch
    import torch.nn.functional as F

    state = generator.get_state()
    targets = torch.randint(0, output.shape[-1], output.shape[:-1], generator=generator)
    generator.set_state(state)  # the next call (the other model's) draws the same
    return F.cross_entropy(output.flatten(0, -2).float(), targets.flatten().to(output.device))
