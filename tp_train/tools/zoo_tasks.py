"""The zoo's tasks: which Hugging Face families each covers, how one is built from a tiny config, the batches it
trains on and its loss (`tp_train.tools.zoo`).

- `causal-lm`: `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` (`AutoModelForCausalLM`), on token ids, next-token loss;
- `masked-lm`: `MODEL_FOR_MASKED_LM_MAPPING_NAMES` (`AutoModelForMaskedLM`);
- `seq2seq-lm`: `MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES` (`AutoModelForSeq2SeqLM`: T5, BART, ...);
- `speech-seq2seq`: `MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES` (`AutoModelForSpeechSeq2Seq`: Whisper, ...);
- `image-classification`: `MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES` (`AutoModelForImageClassification`);
- `dual-encoder`: `MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES`, the whole model (CLIP, SigLIP);
- `towers`: each dual encoder's text and vision tower (`clip.text`: its own tower class, `CLIPTextModel`).

Every task but `causal-lm` trains on the batch `parallelize` probes the model with by default
(`tp_train.plan.probe_input.dummy_batch`: token ids, pixel values, audio features, decoder token ids, as its config
says), drawn anew per step; the loss is the cross-entropy of its
first output (logits, or a tower's hidden states) against random targets over the last dimension, so every
parameter the output depends on gets a gradient.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

TOWERS = ("text", "vision")  # the sub-configs of a dual encoder whose towers the `towers` task builds
BATCH, LENGTH = 2, 16  # examples per batch and tokens per sequence
# Sizes of the parts a text-only tiny config leaves at full size, set wherever a (sub-)config has them: 32 x 32
# images in patches of 8 (16 patches), Swin-like stages of 2 windows of 4 patches, 16 mel bins over 16 encoder
# positions (Whisper's 32 frames), and a classifier of 10 labels.
TASK_FIELDS = dict(image_size=32, patch_size=8, window_size=4, num_mel_bins=16, max_source_positions=16,
                   num_labels=10)  # fmt: skip
# Fields a family needs beyond those, by task family name.
FAMILY_TASK_FIELDS: dict[str, dict] = {}


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


def task_families(task: str) -> list[str]:
    """The families the task covers, by model type (`towers`: `clip.text`, `clip.vision`, ...)."""
    from transformers.models.auto import modeling_auto

    names = sorted(getattr(modeling_auto, TASKS[task].mapping))
    return [f"{name}.{tower}" for name in names for tower in TOWERS] if task == "towers" else names


def build(task: str, family: str):
    """The family's model for the task, from its tiny config (`tp_train.tools.zoo.tiny_config`, with
    `TASK_FIELDS` and `FAMILY_TASK_FIELDS`), randomly initialised from the current seed."""
    import transformers

    from models.hf import hugging_face_model

    if task == "towers":
        return _tower(*family.split("."))
    auto_class = getattr(transformers, TASKS[task].auto_class)
    return hugging_face_model(family, task_config(family), auto_class)


def task_config(model_type: str) -> dict:
    """`tiny_config(model_type)` with the task's sizes set in the config and in every sub-config that has them."""
    from transformers import CONFIG_MAPPING

    from tp_train.tools.zoo import tiny_config

    config = tiny_config(model_type)
    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports it
        return config
    config |= _sized(defaults)
    for field in getattr(type(defaults), "sub_configs", {}):
        sub = getattr(defaults, field, None)
        if isinstance(config.get(field), dict) and sub is not None:
            config[field] |= _sized(sub)
    return config | FAMILY_TASK_FIELDS.get(model_type, {})


def _sized(defaults) -> dict:
    """The `TASK_FIELDS` this config has (`num_labels` is a property of every config, set through `id2label`)."""
    return {field: value for field, value in TASK_FIELDS.items() if field in vars(defaults) or field == "num_labels"}


def _tower(model_type: str, tower: str):
    """A dual encoder's text or vision tower: the family's own tower class (`CLIPTextModel`, `SiglipVisionModel`)
    built from the tiny whole model's sub-config, or the auto class of the sub-config's type (BLIP-2's OPT)."""
    import transformers
    from transformers import PreTrainedModel

    whole = build("dual-encoder", model_type)
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
            from tp_train.tools.zoo import VOCAB

            idx = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator)
            pairs.append((ProbeInput((idx,)), lambda output, idx=idx: _next_token_loss(output, idx)))
            continue
        inputs = dummy_batch(model, LENGTH, BATCH, seed=1234 + 10 * step)
        if inputs is None:
            raise ValueError(f"{type(model).__name__} takes no input the zoo can make up ({model.main_input_name})")
        pairs.append((inputs, lambda output, generator=generator: _random_target_loss(output, generator)))
    return pairs


def output_tensor(output):
    """The tensor a task's loss reads: the logits, else the first tensor (a tower's hidden states)."""
    from tp_train.plan.verify import first_tensor

    return first_tensor(output)


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
