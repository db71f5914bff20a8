"""`model=hf`: Hugging Face causal LMs built from a family's config by `models.hugging_face_causal_lm`, sharded with
HF's own `base_model_tp_plan` or a preset. (GPT-NeoX parity at tp 1, 2, 4 is in tests/test_parallelize.py.)"""

from __future__ import annotations

import pytest
import torch

from models import hugging_face_causal_lm
from tests.distributed import run_on_ranks
from tests.parity import parity_errors
from tests.test_parallelize import VOCAB, _hf_gpt_neox, _hf_logits
from tp_train.plan.deciding.match import match_plan
from tp_train.plan.deciding.resolve import find_plan

TINY = dict(
    vocab_size=VOCAB, max_position_embeddings=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2,
)  # fmt: skip


@pytest.mark.parametrize(
    "model_type, plan_source",
    [
        ("llama", "base_model_tp_plan"),
        ("gpt_neox", "base_model_tp_plan"),
        ("qwen2", "base_model_tp_plan"),
        ("gpt2", "preset"),
        ("opt", "preset"),
    ],
)
def test_one_set_of_generic_sizes_builds_each_family_on_meta_with_a_plan_that_applies(model_type, plan_source):
    with torch.device("meta"):
        model = hugging_face_causal_lm(model_type, config=TINY)
    config = model.config
    assert all(p.is_meta for p in model.parameters())
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (64, 2, 4)  # attribute_map
    assert config.vocab_size == VOCAB and config.max_position_embeddings == 32
    assert getattr(config, "num_key_value_heads", 2) == 2  # set where the family has kv heads
    plan, source = find_plan(model)
    assert plan_source in source
    assert match_plan(model, plan, 2)  # what preflight checks


def test_a_config_key_the_family_does_not_have_is_a_one_line_error():
    with pytest.raises(ValueError, match="config.hiden_size=64: LlamaConfig has no field 'hiden_size'") as error:
        hugging_face_causal_lm("llama", config={"hiden_size": 64})
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="type=lama is not a Hugging Face model_type; use one of llama"):
        hugging_face_causal_lm("lama")


def _wrong_neox_split(rank, world_size):
    """The negative control: NeoX's per-head [q_h; k_h; v_h] projection split as if it were [q; k; v]."""
    torch.manual_seed(0)
    model = _hf_gpt_neox()
    model._tp_plan["gpt_neox.layers.*.attention.query_key_value"] = "fused_qkv_colwise"
    # verify=False: parity alone must catch the wrong split (verification would refuse it first).
    return parity_errors(model, _hf_logits, VOCAB, steps=1, parallelize_kwargs=dict(verify=False))["logits"]


@pytest.mark.slow
def test_a_wrong_split_of_neox_fused_projection_is_caught():
    error = run_on_ranks(_wrong_neox_split, 2)[0]
    assert error > 1e-3, error  # it runs, but computes something else


def test_a_directory_built_off_the_meta_device_is_loaded_whole(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    _hf_gpt_neox().save_pretrained(tmp_path)
    model = hugging_face_causal_lm(path=str(tmp_path))
    assert not hasattr(model, "pretrained_weights")  # nothing left for tp_train to fill
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    with torch.device("meta"):
        assert next(hugging_face_causal_lm(path=str(tmp_path / "bf16")).parameters()).dtype == torch.float32
    with pytest.raises(ValueError, match="path=.*: no config.json there; use a directory written by save_pretrained"):
        hugging_face_causal_lm(path=str(tmp_path / "missing"))


def test_preflight_builds_model_hf_on_meta_and_refuses_what_cannot_run(tmp_path):
    from hydra.utils import instantiate

    from tests.test_configs import _compose
    from tp_train.app import preflight

    def check(*overrides):
        cfg = _compose(tmp_path, ["model=hf", "data.vocab_size=512", *overrides])
        preflight.check(cfg, lambda: instantiate(cfg.model))

    check("tp=2")
    with pytest.raises(preflight.ConfigError, match="data.vocab_size=512 exceeds the model's vocabulary of 300"):
        check("tp=2", "model.config.vocab_size=300")
    check("tp=4")  # 2 kv heads over 4 ranks: each held by the 2 ranks whose query heads use it
    with pytest.raises(preflight.ConfigError, match="config.num_attention_heads=4 is not divisible by .*=8"):
        check("tp=8")
    check("experiment=smoke")  # the smoke preset's GPT sizes (n_layer, ...) size a Hugging Face model too
    for family in ("llama", "gpt2"):
        cfg = _compose(tmp_path, ["model=hf", f"model.type={family}", "experiment=smoke"])
        with torch.device("meta"):
            config = instantiate(cfg.model)().config
        assert (config.num_hidden_layers, config.num_attention_heads, config.hidden_size) == (2, 4, 64), family
    with pytest.raises(preflight.ConfigError, match="model.type=llama cannot be built .*: config.n_layr=2: Llama"):
        check("+model.config.n_layr=2")


def test_a_special_id_the_datas_tokenizer_lacks_is_dropped_unless_the_family_needs_it():
    """The trained tokenizer has EOS (id 0) alone. RoBERTa's embeddings count positions from the pad id (camembert,
    data2vec-text: `input_ids.ne(None)` failed the one-batch check), so a default pad id inside the vocabulary and
    apart from the data's ids stays; CWM's config refuses a None `bos_token_id` and takes the data's EOS; Gemma's pad
    id 0 (the data's EOS) and Phi-3's 32000 (outside) are dropped (issue 41)."""
    from models.hf import _layered_fields

    data = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": 0}
    expected = {"camembert": (1, None, 0), "data2vec-text": (1, None, 0), "cwm": (None, 0, 0),
                "gemma": (None, None, 0), "phi3": (None, None, 0)}  # fmt: skip
    for family, ids in expected.items():
        fields = _layered_fields(family, {"vocab_size": 300}, data, {})
        assert tuple(fields[name] for name in data) == ids, (family, fields)


@pytest.mark.parametrize("family", ["phi3", "smollm3", "glm4"])
def test_a_config_built_from_model_type_takes_the_special_ids_of_the_datas_tokenizer(tmp_path, family):
    """Phi-3's, SmolLM3's and GLM-4's default pad/eos ids lie outside the data's vocabulary (the embedding refused
    Phi-3's pad id 32000): the tokenizer trained on the corpus has EOS (id 0) alone, so pad and bos are dropped; a
    value set in model.config still wins (issue 41)."""
    from hydra.utils import instantiate

    from tests.test_configs import _compose

    cfg = _compose(tmp_path, ["model=hf", f"model.type={family}", "data.vocab_size=512"])
    with torch.device("meta"):
        config = instantiate(cfg.model)().config
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (None, None, 0)
    cfg = _compose(
        tmp_path, ["model=hf", f"model.type={family}", "data.vocab_size=512", "+model.config.pad_token_id=7"]
    )
    with torch.device("meta"):
        assert instantiate(cfg.model)().config.pad_token_id == 7


def test_a_family_takes_its_records_fields_and_a_model_that_cannot_run_one_batch_is_one_line(tmp_path):
    """DeepSeek-V3 with the generic 2 kv heads failed inside its attention at any tp: the app takes its record's
    fields (kv heads as many as query heads); AXK2's latent attention needs as many too: with the user's 2,
    preflight refuses in one line naming the family, the fields and the one its small config sets otherwise, before
    any rank starts. MoE experts that refuse fp32 on the meta device still pass (issues 41 and 54)."""
    from hydra.utils import instantiate

    from tests.test_configs import _compose
    from tp_train.app import preflight

    def check(*overrides):
        cfg = _compose(tmp_path, ["model=hf", "data.vocab_size=512", "tp=2", *overrides])
        preflight.check(cfg, lambda: instantiate(cfg.model))

    check("model.type=deepseek_v3")
    check("model.type=mixtral")
    check("model.type=axk2")
    with pytest.raises(preflight.ConfigError) as refused:  # the user's own 2 kv heads win over the record's
        check("model.type=axk2", "model.config.num_key_value_heads=2")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("model.type=axk2 cannot run one batch of (2, ")
    assert "num_attention_heads=4, num_key_value_heads=2" in message
    assert "its small config (model.type=axk2 alone) sets num_key_value_heads=4 (model.config: 2)" in message


@pytest.mark.parametrize(
    ("family", "override", "field", "record", "given"),
    [
        ("deepseek_v3", "num_key_value_heads=4", "num_key_value_heads", 8, 4),
        ("dbrx", "hidden_size=64", "d_model", 32, 64),
    ],
)
def test_a_size_the_user_sets_wins_over_the_family_records(tmp_path, family, override, field, record, given):
    """hf.yaml's generic sizes give way to the family record's (DeepSeek-V3's kv heads as many as query heads,
    DBRX's `d_model`, its `hidden_size`); a size set on the command line wins over both. The record's kv heads used
    to replace the user's silently (issue 41)."""
    from hydra.utils import instantiate

    from tests.test_configs import _compose

    heads = ["model.config.num_attention_heads=8"] if family == "deepseek_v3" else []  # its record: kv as many
    for overrides, expected in (([], record), ([f"model.config.{override}"], given)):
        cfg = _compose(tmp_path, ["model=hf", f"model.type={family}", "data.vocab_size=512", *heads, *overrides])
        with torch.device("meta"):
            config = instantiate(cfg.model)().config
        assert getattr(config, field) == expected, (overrides, getattr(config, field))


def test_a_training_step_and_the_preflight_batch_build_no_generation_cache():
    """Bamba's tiny two layers hold no attention layer for its default cache's `get_seq_length`: `python train.py
    model=hf model.type=bamba` (and bailing_hybrid) was refused at preflight, and its step raised; BLT was refused
    at preflight for what building the default cache raised (issue 41)."""
    from omegaconf import OmegaConf

    from tp_train.app import preflight
    from tp_train.app.module import CausalLMModule
    from tp_train.tools.zoo import build_family

    logits = CausalLMModule(build_family("causal-lm", "bamba"), optimizer=None)(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape[:2] == (2, 8)
    for family in ("bamba", "blt"):  # BLT's cache reads a layer count its config keeps in sub-configs only
        cfg = OmegaConf.create({"model": {"type": family, "path": None, "config": {}}, "data": {"block_size": 8}})
        with torch.device("meta"):
            model = build_family("causal-lm", family)
        preflight._check_one_batch(cfg, model)
