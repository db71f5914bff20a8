"""The zoo tool (`python -m tp_train.tools.zoo`) classifies Hugging Face families: a family that shards right
passes, one the planner cannot plan is refused in one line with its reason, and the summary counts them."""

from __future__ import annotations

import pytest

from tp_train.tools.zoo import families, run_zoo, summary


def test_the_zoo_lists_every_causal_lm_family():
    names = families()
    assert {"llama", "gpt2", "bloom", "mamba"} <= set(names) and len(names) > 100


@pytest.mark.slow
def test_the_zoo_classifies_a_passing_and_a_refused_family():
    results = run_zoo(["gpt2", "jetmoe"], tp=2, jobs=2, timeout=300, echo=lambda line: None)
    assert results["gpt2"]["class"] == "pass", results["gpt2"]
    assert results["jetmoe"]["class"] == "refused", results["jetmoe"]
    assert "\n" not in results["jetmoe"]["reason"] and "model.layers.0.self_attention" in results["jetmoe"]["reason"]
    text = summary(results, tp=2)
    assert text.startswith("1 of 2 buildable families pass at tp=2 (50%); round-off 0, refused 1, WRONG 0"), text
    assert "refused  jetmoe" in text


def test_block_share_counts_blocks_not_model_level_lists_of_projections():
    """The `unsharded` class measures the repeated blocks: Gemma 3n's model-level AltUp projections (a list of bare
    Linears applied once each) are not block matrices; its blocks' attention, MLP and small AltUp parts are."""
    import torch

    from models.hf import hugging_face_causal_lm
    from tp_train.plan.deciding.coverage import in_block
    from tp_train.tools.zoo import tiny_config

    with torch.device("meta"):
        model = hugging_face_causal_lm("gemma3n_text", config=tiny_config("gemma3n_text"))
    names = [name for name, _ in model.named_parameters()]
    outside = [name for name in names if not in_block(model, name)]
    assert "model.altup_projections.0.weight" in outside and "model.altup_unembed_projections.2.weight" in outside
    assert "model.embed_tokens.weight" in outside
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.altup.correction_coefs.weight"):
        assert in_block(model, name), name


def test_the_unsharded_bar_is_the_fraction_held_whole_at_every_tp():
    """A pass holds at most 15% of the trained block matrices whole on every rank, at tp 2 as at tp 4: MLA's latent
    a-projections kept whole (12% at the tiny sizes: a rank holds 0.56 of the block matrices at tp 2, 0.34 at tp 4)
    pass at both; 20% whole is `unsharded` at both. With an attention the planner keeps whole, a pass still splits
    1/tp + 0.15 of them."""
    from tp_train.tools.zoo.check import too_much_held

    for tp in (2, 4, 8):
        assert too_much_held(0.12, tp, kept_whole=False) == "", tp
        assert too_much_held(0.20, tp, kept_whole=False) == "0.20 of the trained block matrices are whole on every rank"
    assert too_much_held(0.3, 2, kept_whole=True) == ""  # 0.7 split at tp 2: 1/2 + 0.15 needed
    assert "only 0.30 of the trained block matrices are split" in too_much_held(0.7, 4, kept_whole=True)


def test_block_share_reads_the_blocks_on_the_unsharded_model():
    """A block whose Linears were all swapped for parallel layers (GPT-2's Conv1D, a rank's half of it) still counts:
    its blocks are found on the unsharded model, so a block beside it holding a whole weight shows half of them
    whole, not none (nothing counted let any whole weight of such a block pass unseen). A convolution wider than 1 x 1
    (PVT's sequence reduction), which no column or row style splits, is not counted."""
    import copy

    import torch
    import torch.nn as nn
    from transformers.pytorch_utils import Conv1D

    from tp_train.tools.zoo.check import _block_share

    class Half(nn.Module):  # a parallel layer as the sharded model holds it: no Linear, half the weight
        def __init__(self, weight):
            super().__init__()
            self.weight = nn.Parameter(weight[:, : weight.shape[1] // 2].clone())

    reference = nn.Module()
    reference.blocks = nn.ModuleList([nn.Module()])
    reference.blocks[0].fc, reference.blocks[0].router = Conv1D(8, 4), nn.Conv1d(4, 8, 1, bias=False)  # 32 each
    reference.blocks[0].reduce = nn.Conv1d(4, 4, 3)  # a convolution wider than 1x1: not counted
    model = copy.deepcopy(reference)
    model.blocks[0].fc = Half(reference.blocks[0].fc.weight)
    for param in reference.parameters():
        param.grad = torch.zeros_like(param)
    assert _block_share(model, reference) == (0.5, "blocks.0.router.weight")


def _rank_with_a_stricter_bar(*args):
    """A zoo rank whose `unsharded` bar is 10% held whole (RWKV's receptance and time mixes: 13%)."""
    from tp_train.tools.zoo import check, runner

    check.WHOLE = 0.1
    runner._rank_main(*args)


@pytest.mark.slow
def test_round_off_in_a_family_that_holds_too_much_is_unsharded_not_wrong():
    """RWKV at tp 4: its embedding's gradient (~170, through `pre_ln` of a 1e-4-wide embedding) differs by ~1e-4 in
    float32 and matches in float64, while its channel-mix receptance and time mixes are whole on every rank (0.13 of
    the block matrices, over a bar of 0.1 in this test): the same function, holding too much (`unsharded`), never
    `WRONG`."""
    result = run_zoo(["rwkv"], tp=4, jobs=1, timeout=300, echo=lambda line: None, target=_rank_with_a_stricter_bar)
    result = result["rwkv"]
    assert result["class"] == "unsharded", result
    assert result["reason"].startswith("float32 round-off (gradient of rwkv.embeddings.weight"), result
    assert "float64 matches" in result["reason"] and "0.13 of the trained block matrices are whole" in result["reason"]


@pytest.mark.slow
def test_codegens_grouped_attention_with_few_heads_is_split_not_kept_whole():
    """CodeGen with 4 heads: its forward reshapes qkv_proj's output into four groups of [q; v; k]. The planner used
    to keep that attention whole on every rank at tp 2 (and the family was `unsharded`); since this session's planner
    changes it splits it, with parity, and the family passes. (The `unsharded` threshold itself: the RWKV test.)"""
    fields = {"num_attention_heads": 4}
    result = run_zoo(["codegen"], tp=2, jobs=1, timeout=300, echo=lambda line: None, fields=fields)["codegen"]
    assert result["class"] == "pass" and not result["kept_whole"], result


@pytest.mark.parametrize("model_type", ["gemma3", "mllama", "qwen3_5", "phi4_multimodal", "dots3_note"])
def test_tiny_config_shrinks_every_sub_config(model_type):
    """Multimodal families keep their sizes in sub-configs (text, vision, audio): each is made tiny, so the model
    builds small (at full size they ran out of time or memory in the zoo)."""
    import torch

    from models.hf import hugging_face_causal_lm
    from tp_train.tools.zoo import tiny_config

    with torch.device("meta"):
        model = hugging_face_causal_lm(model_type, config=tiny_config(model_type))
    assert sum(p.numel() for p in model.parameters()) < 7_000_000


CONSISTENT = ["deepseek_v3", "longcat_flash", "mimo_v2_flash", "falcon", "gpt_neo", "whisper", "plbart", "mamba2",
              "nemotron_h", "bamba", "granitemoehybrid"]  # fmt: skip


@pytest.mark.parametrize("model_type", CONSISTENT)
def test_tiny_config_is_consistent_for_latent_attention_and_doubled_kv_heads(model_type):
    """Latent attention's rotary, plain and value widths, MiMo's doubled sliding-window kv heads, Falcon's derived
    (read-only) head width, GPT-Neo's per-layer attention kinds, encoder-decoder head counts and the heads and groups
    of Mamba2-style hybrids agree with the tiny sizes: the model builds and the unsharded model runs."""
    import torch

    from models.hf import hugging_face_causal_lm
    from tp_train.plan.probe import forward_without_cache
    from tp_train.tools.zoo import VOCAB, tiny_config

    torch.manual_seed(0)
    model = hugging_face_causal_lm(model_type, config=tiny_config(model_type))
    assert forward_without_cache(model, torch.randint(0, VOCAB, (1, 8))).logits.shape == (1, 8, VOCAB)


@pytest.mark.parametrize(
    "model_type",
    [
        "prophetnet",  # refuses num_hidden_layers (encoder and decoder counts instead)
        "xlnet",  # refuses max_position_embeddings; its d_head must be hidden / heads
        "zamba2",  # a fixed 54-entry layers_block_type, kept at the default count
        "granitemoehybrid",  # Mamba2 heads x head width = expand x hidden
        "falcon_h1",  # the same, with the mixer's width given as mamba_d_ssm
        "dots1",  # expert counts None by default
        "gemma3n_text",  # more kv-sharing layers than the tiny model has
        "gemma4_text",  # head_dim kept per layer: read as one value it raises
        "zamba",  # its shared attention is tied across hybrid layers: two of them
        # defaults that build no model that runs (the record's zoo_fields carry what a checkpoint sets)
        "dbrx",
        "lfm2_moe",
        "cohere_compass_text",
        "reformer",
    ],
)
def test_tiny_config_builds_families_whose_defaults_disagree_with_the_tiny_sizes(model_type):
    """Each family here was `unbuildable` in the zoo because of the tiny config, not the family: it builds and the
    unsharded model runs."""
    import torch

    from models.hf import hugging_face_causal_lm
    from tp_train.plan.probe import forward_without_cache
    from tp_train.tools.zoo import VOCAB, tiny_config

    torch.manual_seed(0)
    model = hugging_face_causal_lm(model_type, config=tiny_config(model_type)).eval()  # Reformer trains on 64
    assert forward_without_cache(model, torch.randint(0, VOCAB, (1, 8))).logits.shape == (1, 8, VOCAB)


def test_tiny_config_keeps_one_layer_of_each_kind_of_a_per_layer_list():
    """Zamba2's default layer list starts with Mamba layers: shortened, it keeps the first layer and a hybrid one."""
    from tp_train.tools.zoo import tiny_config

    assert tiny_config("zamba2")["layers_block_type"] == ["linear_attention", "hybrid"]
    assert "layer_types" not in tiny_config("qwen2")  # a list the family re-derives from the tiny count is left alone


@pytest.mark.parametrize(
    "task,expected",
    [
        ("masked-lm", {"bert", "roberta", "albert"}),
        ("seq2seq-lm", {"t5", "bart", "mt5", "pegasus"}),
        ("speech-seq2seq", {"whisper", "speech_to_text"}),
        ("image-classification", {"vit", "deit", "beit", "swin"}),
        ("dual-encoder", {"clip", "siglip"}),
        ("towers", {"clip.text", "clip.vision", "siglip.vision"}),
    ],
)
def test_the_zoo_lists_every_family_of_each_task(task, expected):
    assert expected <= set(families(task))


def test_a_network_with_no_linear_in_its_blocks_is_not_counted_as_a_transformer():
    """ResNet's blocks are convolutions: nothing for a column/row split to take, so it is `no blocks`, apart from
    the transformers a task's share of passing families is counted over; ViT's blocks are Linears."""
    import torch

    from tp_train.tools.zoo import build_family, has_block_linears

    with torch.device("meta"):
        assert not has_block_linears(build_family("image-classification", "resnet"))
        assert has_block_linears(build_family("image-classification", "vit"))
    text = summary({"vit": {"class": "pass", "reason": ""}, "resnet": {"class": "no blocks", "reason": "convs"}}, 2)
    assert (
        text.startswith("1 of 1 buildable families pass at tp=2 (100%)") and "1 with no Linear in their blocks" in text
    )


@pytest.mark.parametrize("model_type", ["levit", "mobilevit"])
def test_every_attention_of_a_tiny_vision_family_has_tokens_to_mix(model_type):
    """With one token, an attention's heads act alike and no probe shows a split by heads (LeViT's last stage at 64 x
    64 pixels; MobileViT's stages in the task's patches of 8): the tiny images give every attention more than one."""
    import torch

    from tp_train.plan.probe_input import probe_input
    from tp_train.tools.zoo import build_family

    torch.manual_seed(0)
    model = build_family("image-classification", model_type).eval()
    tokens = {}

    def record(name):
        def hook(module, args):
            tokens[name] = args[0].shape[-2]

        return hook

    for name, module in model.named_modules():
        if isinstance(getattr(module, "num_attention_heads", None), int):
            module.register_forward_pre_hook(record(name))
    with torch.no_grad():
        probe_input(model, None)(model)
    assert tokens and min(tokens.values()) > 1, tokens


@pytest.mark.parametrize("task,model_type", [("speech-seq2seq", "vibevoice"), ("seq2seq-lm", "vibevoice_asr")])
def test_tiny_config_shrinks_the_sub_configs_of_sub_configs(task, model_type):
    """VibeVoice's audio tokenizers kept their 6 stages doubling 32 filters to 2048 (1.0 and 0.7 billion parameters,
    8.4 GB a rank at tp 2): run beside another family, the ranks were killed for memory. The `zoo_fields` of the
    sub-config's own model type make them small."""
    import torch

    from tp_train.tools.zoo import build_family

    with torch.device("meta"):
        model = build_family(task, model_type)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def _rank_killed(model_type: str, case: dict, rank: int, world_size: int, port: int, results) -> None:
    """Stands in for the zoo's rank (`_rank_main`): rank 0 sends a pass at once; rank 1 is killed by SIGKILL (as the
    out-of-memory killer does) in every attempt at `always`, in the first only at `once`."""
    import os
    import signal
    from pathlib import Path

    if rank == 0:
        results.send({"class": "pass", "reason": "rank 0 saw nothing wrong"})
        return
    attempts = Path(case["fields"]["directory"]) / model_type
    first = not attempts.exists()
    attempts.write_text(attempts.read_text() + "x" if not first else "x")
    if model_type == "always" or first:
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
def test_a_rank_killed_by_a_signal_is_killed_not_a_pass_and_is_checked_again_alone(tmp_path):
    """A family whose rank the kernel kills is `killed` even when rank 0 reports a pass, and is run again alone once
    the others are done: `once` (killed beside another family only) then passes; `always` stays `killed`."""
    lines = []
    results = run_zoo(["always", "once"], tp=2, jobs=2, echo=lines.append, fields={"directory": str(tmp_path)},
                      target=_rank_killed)  # fmt: skip
    assert results["always"]["class"] == "killed", results
    assert results["always"]["reason"] == "killed: rank 1 by SIGKILL (out of memory, if SIGKILL)", results
    assert results["once"]["class"] == "pass", results
    assert (tmp_path / "always").read_text() == "xx" and (tmp_path / "once").read_text() == "xx"
    assert "again, one at a time: always, once" in lines
    assert ", killed 1, error 0" in summary(results, tp=2)


def _rank_deadlocked(model_type: str, case: dict, rank: int, world_size: int, port: int, results) -> None:
    """Stands in for the zoo's rank: rank 0 waits in an all-reduce that rank 1, waiting elsewhere, never joins."""
    import os
    from datetime import timedelta

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    if rank == 0:
        _waits_in_an_all_reduce()
    else:
        _waits_for_nothing()


def _waits_in_an_all_reduce():
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1))


def _waits_for_nothing():
    import threading

    threading.Event().wait()


@pytest.mark.slow
def test_a_family_whose_ranks_hang_is_killed_with_where_each_rank_waited():
    results = run_zoo(["hangs"], tp=2, jobs=1, timeout=40, echo=lambda line: None, target=_rank_deadlocked)
    result = results["hangs"]
    assert result["class"] == "killed", result
    assert result["reason"].startswith("killed: no result within 40s, ranks [0, 1] still running"), result
    assert "rank 0 in all_reduce (distributed_c10d.py:" in result["reason"], result
    assert "< _waits_in_an_all_reduce (test_zoo.py:" in result["reason"], result
    assert "rank 1 in wait (threading.py:" in result["reason"] and "< _waits_for_nothing" in result["reason"], result
    assert "all_reduce" in result["stacks"][0] and "_waits_for_nothing" in result["stacks"][1], result
    assert ", killed 1, error 0" in summary(results, tp=2)


def test_kv_heads_are_not_set_where_the_config_reads_them_as_the_query_heads():
    """Whisper's config maps `num_key_value_heads` onto `encoder_attention_heads`, its query heads: the zoo's 2 kv
    heads would make it a 2-head model that tp=4 cannot split, so the setting skips it; Llama's are set."""
    from tp_train.tools.zoo.configs import _own_fields

    assert _own_fields("whisper", {"num_key_value_heads": 2}) == {}
    assert _own_fields("llama", {"num_key_value_heads": 2}) == {"num_key_value_heads": 2}
