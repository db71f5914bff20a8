"""Where Hugging Face decoder LMs split into pipeline stages, and that each stage runs its part of the model's own
forward: the stages chained in one process (stage k's output into stage k+1) give the whole model's logits, for
Llama, Qwen2, Mistral, Gemma and GPT-2 (rotary embeddings and causal masks computed on every stage by the base
model's own code, the embedding on the first, the final norm and head on the last) at 2 and 4 stages. Modules
outside the blocks are told apart by call order, not registration order: a model that registers its head first
still splits with its head on the last stage. No ranks: `StageForward` needs none."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from tp_train.checkpoint.stages import parameter_names
from tp_train.parallel.pipeline.split import PipelineSplit
from tp_train.parallel.pipeline.stage import StageForward, cut_stage
from tp_train.training.pipeline_split import plan_pipeline_split

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, n_layer=4, n_embd=32, n_head=4, bos_token_id=1, eos_token_id=2,
             pad_token_id=0)  # fmt: skip


def _chained(model: nn.Module, stages: int, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `model`'s `stages` stages (cut from copies) run one after another."""
    split = plan_pipeline_split(model, stages)
    inputs = (ids,)
    for stage in range(stages):
        inputs = StageForward(cut_stage(copy.deepcopy(model), split, stage), split, stage)(*inputs)
    return inputs


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "mistral", "gemma", "gpt2"])
def test_hugging_face_stages_chained_give_the_whole_models_logits(model_type):
    config = AutoConfig.for_model(model_type, **SIZES)
    config.tie_word_embeddings = model_type in ("gemma", "gpt2")  # both kinds of head
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    split = plan_pipeline_split(model, 2)
    blocks = "transformer.h" if model_type == "gpt2" else "model.layers"
    head = ("transformer.ln_f" if model_type == "gpt2" else "model.norm", "lm_head")
    assert split.blocks == blocks and split.after == head
    ids = torch.randint(3, SIZES["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids).logits
        for stages in (2, 4):
            assert (_chained(model, stages, ids) - whole).abs().max().item() < 1e-6, stages


class HeadFirstLM(nn.Module):
    """Registers its head and final norm before its embedding and blocks: registration order is not call order."""

    tp_plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(16, 32, bias=False)
        self.norm = nn.LayerNorm(16)
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.lm_head(self.norm(hidden))


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.down(torch.relu(self.up(hidden)))


def test_modules_outside_the_blocks_split_by_call_order():
    torch.manual_seed(0)
    model = HeadFirstLM()
    split = plan_pipeline_split(model, 2)
    assert split.before == ("embed",) and split.after == ("lm_head", "norm")
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        assert torch.allclose(_chained(model, 2, ids), model(ids), atol=1e-6)


def test_a_split_against_call_order_fails_loudly():
    """A meta model's split falls back to registration order: where that is wrong, the last stage says so instead of
    computing with zeros in place of its head."""
    model = HeadFirstLM()
    wrong = PipelineSplit("layers", ((0,), (1, 2)), before=("lm_head", "norm", "embed"), after=())
    hidden, ids = StageForward(cut_stage(copy.deepcopy(model), wrong, 0), wrong, 0)(torch.randint(0, 32, (2, 5)))
    last = StageForward(cut_stage(copy.deepcopy(model), wrong, 1), wrong, 1)
    with pytest.raises(RuntimeError, match="'norm' was taken for a module running before the blocks, but runs after"):
        last(hidden, ids)


def test_a_stage_names_its_tied_parameter_as_the_whole_model_does():
    """The last stage holds GPT-2's tied weight only as `lm_head.weight`; checkpoints name it as the whole model
    does (the embedding's name), so its optimizer state is one entry at every pp."""
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", **SIZES))
    split = plan_pipeline_split(model, 2)
    holder = nn.Module()
    holder.model = cut_stage(copy.deepcopy(model), split, 1)  # as a LightningModule holds it
    names = parameter_names(holder)
    assert names[id(holder.model.lm_head.weight)] == "model.transformer.wte.weight"
    assert names[id(holder.model.transformer.ln_f.weight)] == "model.transformer.ln_f.weight"
