"""The probe comes from the model's real inputs: `parallelize(example_input=...)` takes a tensor, a tuple or a dict
of keyword arguments; Hugging Face models with none are probed on the batch their config shapes; a model the
planner cannot probe is refused in one line naming it and the forward argument, and a failing probe names the module
where it failed. Through Lightning, a ViT classifier (no nn.Embedding: nothing to draw token ids for) is planned
from the LightningModule's `example_input_array`, or from its first training batch, and trains at tp=2 with plain
Lightning's losses."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import tp_train
from tests.distributed import run_on_ranks
from tests.lightning_helpers import StepRecorder, make_trainer
from tp_train.plan.probe_input import ProbeInput, dummy_batch, probe_input
from tp_train.tools.zoo import build_family as build

STEPS, BATCH, LABELS = 5, 4, 10


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class KeywordMLP(nn.Module):
    """Two MLP blocks over `features` and `scale`, keyword-only: no token ids, nothing but its example to probe."""

    def __init__(self, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(2))

    def forward(self, *, features: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        for block in self.blocks:
            features = features + scale * block(features)
        return features


MLP_PLAN = {"blocks.*.fc": "colwise", "blocks.*.proj": "rowwise"}


class _Arguments(nn.Module):
    def forward(self, *args, **kwargs):
        return args, kwargs


def test_an_example_input_is_a_tensor_a_tuple_or_a_dict():
    """Lightning's `example_input_array` convention: a tensor is the one argument, a tuple the positional ones, a
    dict the keyword ones."""
    x = torch.ones(2, 4)
    assert ProbeInput.of(x)(_Arguments()) == ((x,), {})
    assert ProbeInput.of((x, 3))(_Arguments()) == ((x, 3), {})
    assert ProbeInput.of({"features": x})(_Arguments()) == ((), {"features": x})
    with pytest.raises(TypeError, match="example_input=str: pass a tensor, a tuple"):
        ProbeInput.of("pixels")


def test_the_auto_planner_probes_the_keyword_arguments_it_is_given():
    example = {"features": torch.randn(2, 6, 16), "scale": 0.5}
    assert dict(tp_train.infer_plan(KeywordMLP(), 2, example_input=example)) == MLP_PLAN


def test_a_model_the_planner_cannot_probe_is_refused_naming_it_and_its_forward_argument():
    with pytest.raises(ValueError) as refusal:
        tp_train.infer_plan(KeywordMLP(), 2)
    message = str(refusal.value)
    assert "\n" not in message
    assert "needs an example input for KeywordMLP's forward argument `features`" in message, message
    assert "example_input=" in message and "example_input_array" in message


def test_a_failing_probe_names_the_module_where_it_failed():
    with pytest.raises(ValueError) as refusal:  # 8 features where the first block's Linear takes 16
        tp_train.infer_plan(KeywordMLP(), 2, example_input={"features": torch.randn(2, 6, 8)})
    message = str(refusal.value)
    assert "\n" not in message
    assert "could not run KeywordMLP on its probe input (features (2, 6, 8), scale" not in message
    assert "on its probe input (features (2, 6, 8)) in the forward of 'blocks.0.fc': RuntimeError" in message, message


@pytest.mark.parametrize(
    "task,family,expected",
    [
        ("image-classification", "vit", {"pixel_values": (1, 3, 32, 32)}),
        ("seq2seq-lm", "t5", {"input_ids": (1, 8), "decoder_input_ids": (1, 8)}),
        ("speech-seq2seq", "whisper", {"input_features": (1, 16, 32), "decoder_input_ids": (1, 8)}),
        ("dual-encoder", "clip", {"input_ids": (1, 8), "pixel_values": (1, 3, 32, 32)}),
        ("masked-lm", "bert", {"input_ids": (1, 8)}),
    ],
)
def test_hugging_face_models_are_probed_on_a_batch_their_config_shapes(task, family, expected):
    """The main input (Whisper's mel bins x twice its encoder positions), decoder ids for encoder-decoders, and
    CLIP's pair; multimodal LMs (which generate) keep text alone."""
    torch.manual_seed(0)
    model = build(task, family)
    inputs = probe_input(model)
    assert {name: tuple(value.shape) for name, value in inputs.kwargs.items()} == expected
    assert not inputs.args
    again = dummy_batch(model)  # the same batch every time: every rank probes the same input
    assert all(torch.equal(value, again.kwargs[name]) for name, value in inputs.kwargs.items())


# ------------------------------------------------------------------------------------------- through Lightning


class LitViT(L.LightningModule):
    """A Hugging Face ViT classifier behind a LightningModule whose forward takes images; `example_input_array`
    set, or not (then the strategy probes with the first training batch)."""

    def __init__(self, with_example: bool):
        super().__init__()
        self.model = build("image-classification", "vit")
        if with_example:
            self.example_input_array = torch.randn(2, 3, 32, 32)

    def forward(self, images):
        return self.model(pixel_values=images).logits

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _images() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    images = torch.randn(STEPS * BATCH, 3, 32, 32, generator=generator)
    return TensorDataset(images, torch.randint(0, LABELS, (STEPS * BATCH,), generator=generator))


def _fit_vit(rank, world_size, tp):
    """Per variant (example_input_array set, not set): the losses of 5 steps, and this rank's share of the ViT
    blocks' matrices."""
    results = {}
    for with_example in (True, False):
        torch.manual_seed(0)
        module, recorder = LitViT(with_example), StepRecorder()
        trainer = make_trainer(tp, [recorder], max_steps=STEPS)
        data = _images()  # plain Lightning: the same order the strategy's (one data-parallel rank) sampler gives
        sampler = DistributedSampler(data, num_replicas=1, rank=0) if tp is None else None
        trainer.fit(module, DataLoader(data, batch_size=BATCH, sampler=sampler))
        blocks = [p for name, p in module.named_parameters() if ".layers." in name and p.dim() == 2]
        results[with_example] = recorder.losses, sum(p.numel() for p in blocks)
    return results


@pytest.fixture(scope="module")
def plain_vit():
    return run_on_ranks(_fit_vit, 1, None, timeout=300)[0]


@pytest.mark.slow
def test_a_vit_classifier_trains_at_tp2_as_plain_lightning_from_its_own_inputs(plain_vit):
    for per_rank in run_on_ranks(_fit_vit, 2, 2, timeout=300):
        for with_example in (True, False):
            (losses, block_elements), (reference, full_elements) = per_rank[with_example], plain_vit[with_example]
            assert len(losses) == STEPS and losses == pytest.approx(reference, abs=1e-5), with_example
            assert block_elements == full_elements // 2  # each rank holds half of every block matrix
