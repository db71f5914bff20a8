"""`python -m tp_train.tools.zoo`: every Hugging Face family of a task (causal LM by default; masked LM, seq2seq LM,
speech seq2seq, image classification, CLIP-style dual encoders and their towers: `tp_train.tools.zoo_tasks`), built
from a tiny config with random weights, sharded with no plan given (`tp_train.parallelize`, verification on, as by
default) on gloo CPU ranks, and compared with the unsharded model: outputs, every gradient and three SGD steps of
losses, within 1e-5.

Each family lands in one class:

- `pass`: sharded, and it matches (a `*` marks one whose attention was kept whole: the rest is sharded);
- `refused`: `parallelize` refused it in one line (a plan it cannot apply, or verification found a difference);
- `round-off`: beyond 1e-5 in float32 but within 1e-9 in float64 (the same function, summed in another order);
- `WRONG`: sharded without complaint, but it computes something else (the worst outcome: none should be here);
- `unsharded`: it matches, but a rank holds more than 1.15/tp of the block matrices that train (some attention or MLP
  left whole on every rank without the planner saying so), or, with an attention the planner keeps whole, less than
  1/tp + 0.15 of them are sharded;
- `killed`: a rank was killed by a signal it did not get from the zoo (the kernel's out-of-memory killer): checked
  again alone once the other families are done, and `killed` only if it is killed again;
- `error`: anything else (a crash, or no result within `--timeout` seconds);
- `unbuildable`: no tiny model could be built from the family's config (not counted among the families);
- `no blocks`: its repeated blocks hold no Linear layer (a convolutional network: ResNet, MobileNet), nothing for a
  column/row split to take (not counted among the families).

Each family runs in its own processes (one per rank, on a free port), `--jobs` families at a time, so a family that
hangs or crashes takes only itself down. Options: `--task masked-lm` (or `all`), `--families llama,bloom`, `--tp 2`,
`--jobs 2`, `--timeout 180`, `--output zoo.json`, `--kv-heads 2` (grouped-query attention: 2 kv heads under the 4
query heads, in every (sub-)config that has kv heads). A setting of the configs (the same fields set in every
family of a run) is `run_zoo(..., fields={...})`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import signal
import socket
import time
from datetime import timedelta

TOLERANCE = 1e-5
VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
# Families whose own layout ties two generic sizes: MiMo-V2-Flash's sliding-window layers have twice the kv heads,
# which must not exceed the query heads.
FAMILY_FIELDS = {
    "mimo_v2_flash": dict(num_key_value_heads=2),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),  # one (global, local) pair: the 2 tiny layers
    # Mamba2: heads x head width = expand x hidden; n_groups stays at its default (8, one group per head), which
    # tp 2 and 4 divide (tp must, as in Megatron); a 16-wide state keeps B and C (n_groups x state_size) small.
    "mamba2": dict(num_heads=8, state_size=16),
    # Nemotron-H's Mamba2 layers the same way (8 heads of 8, its default 8 groups, a 16-wide state).
    "nemotron_h": dict(mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16),
    # Bamba and GraniteMoeHybrid (8 Mamba heads of 8 by `WIDTHS`): a 16-wide state; their default of one group (as
    # real checkpoints have) is kept: every rank holds its B and C (replicated, like kv heads) and the gated norm
    # normalises the group across the ranks (`gated_rmsnorm_parallel`).
    "bamba": dict(mamba_d_state=16),
    # Falcon-H1 the same (its mixer 64 wide by `WIDTHS`' mamba_d_ssm), with μP multipliers other than 1 (so its
    # `mup_vector` differs section by section and a wrong split of it shows) and scaled keys and MLP.
    "falcon_h1": dict(
        mamba_d_state=16, ssm_multipliers=[0.5, 2.0, 0.25, 4.0, 1.5], key_multiplier=0.5, mlp_multipliers=[2.0, 0.5]
    ),  # fmt: skip
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=8),  # 32 heads of 128 by default
    # Reformer's causal LM asserts is_decoder (the default config is an encoder's); its axial position embeddings
    # split the hidden width in two and factor the longest sequence (64 = 8 x 8).
    "reformer": dict(is_decoder=True, axial_pos_embds_dim=(16, 16), axial_pos_shape=(8, 8)),
    # Zamba: its shared attention tied across two hybrid layers; 4 Mamba heads of 16 (2 by default), so tp 2 and 4
    # divide them (each rank holds whole heads).
    "zamba": dict(layers_block_type=["hybrid", "hybrid"], n_mamba_heads=4),
    # Zamba2 (a Mamba2 layer, then a hybrid one): 8 Mamba2 heads of 8 in one group (its default, as real checkpoints
    # have), an 8-wide state, and adapters of rank 8 on its shared MLP (128 by default, 4 times the tiny width).
    "zamba2": dict(mamba_d_state=8, adapter_rank=8),
    # CodeGen reshapes qkv_proj's output into a hard-coded 4 groups of [q; v; k] (`mp_num`), on local heads too: each
    # rank holds its share of every group, so tp x 4 must divide the heads (16 of 2, a rotary width that fits).
    "codegen": dict(num_attention_heads=16, rotary_dim=2),
    # Inkling's sliding-window layers keep head counts and widths of their own (64 heads of 128 by default, kept at
    # the tiny sizes by no generic field), and a relative-position bank (d_rel x rel_extent, 16 x 1024) shared by the
    # heads: a tiny sliding and a tiny full layer, a bank shorter than the input so its distance cut-off shows.
    "inkling_text": dict(layer_types=["hybrid_sliding", "hybrid"], sliding_window_size=5, rel_extent=6)
    | dict(swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=8),
    # BLT's random patcher gives every byte an entropy (about 4.4) above the default threshold (1.34): every byte its
    # own patch, and a patch querying its one byte shows nothing of its queries; above ln(vocab) only the first byte
    # is a patch of its own, the others one long patch.
    "blt": dict(patching_threshold=5.0),
}
# VibeVoice's audio tokenizers (the sub-configs of vibevoice and vibevoice_asr): by default 6 downsampling stages
# that double 32 filters up to 2048 channels (1.0 and 0.7 billion parameters, 8.4 GB a rank at tp 2 with the
# unsharded copy: two such families at once were killed for memory); 2 stages of 4 to 16 filters, one block each.
FAMILY_FIELDS |= {
    name: dict(num_filters=4, downsampling_ratios=[2, 2], depths=[1, 1, 1])
    for name in ("vibevoice_acoustic_tokenizer", "vibevoice_acoustic_tokenizer_encoder")
}
FAMILY_FIELDS["inkling2_text"] = FAMILY_FIELDS["inkling_text"]  # the same layout (its sliding layers: 48 heads of 128)
# Families whose default config builds no model that runs (transformers 5's defaults lack what every checkpoint of the
# family sets): the fields a checkpoint would carry, at the tiny sizes.
FAMILY_FIELDS |= {
    # attention reads attn_config.rope_theta and clamps q/k/v by clip_qkv, which the defaults leave out; the experts'
    # width follows `d_model` only when it is set by that name
    "dbrx": dict(
        d_model=32,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),  # no default layer kinds
    # with Mamba2 layers only its forward cannot build its cache: the second layer is attention; a 16-wide state
    "granitemoehybrid": dict(mamba_d_state=16, layer_types=["linear_attention", "full_attention"]),
    # rotary parameters are looked up per layer kind, and the default has none
    "cohere_compass_text": dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
CLASSES = ("pass", "round-off", "refused", "WRONG", "killed", "error", "unsharded", "unbuildable", "no blocks")
NOT_COUNTED = ("unbuildable", "no blocks")  # classes of families that are not among a task's buildable transformers
UNSHARDED = 1.15  # a pass holds at most this over 1/tp of the trained block matrices (routers, convs, MLA latents)
# With an attention the planner says it keeps whole, a pass still shards at least 1/tp + this of the trained block
# matrices (issue 24's bar); at the tiny sizes (an MLP twice the width) an MLP alone does not reach it.
KEPT_WHOLE_MARGIN = 0.15


# Widths beyond the generic sizes, set wherever a (sub-)config has them as an int: mixture-of-experts widths (tp
# must divide them), DeepSeek-style latent attention (a rotary and a plain part of each query/key head, values 8
# wide, compressed ranks), the widths a vision or audio tower hands to the text model, and an encoder-decoder's
# own head counts, layers and MLP widths (the decoder of Whisper or PLBart keeps its own, ProphetNet has no single
# layer count), a Mamba2 mixer's heads (8 heads of 8 channels: expand x hidden) and Gemma 3n's low-rank residual
# (LAuReL: its rank of 64 would be twice the tiny width).
WIDTHS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, shared_experts_intermediate_size=32,
              expert_intermediate_size=32, expert_ffn_hidden_size=32, kv_lora_rank=16, q_lora_rank=16,
              qk_rope_head_dim=4, qk_nope_head_dim=4, qk_head_dim=8, v_head_dim=8, out_hidden_size=32,
              hidden_size_global=32, projector_input_dim=32, projector_output_dim=32, vision_output_dim=32,
              adapter_in_dim=32, adapter_out_dim=32, adapter_input_size=32, linear_key_head_dim=8,
              linear_value_head_dim=8, index_head_dim=8, index_topk=8, encoder_hash_byte_group_vocab=64,
              vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=64,
              decoder_ffn_dim=64, num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
              num_decoder_attention_heads=4, mamba_n_heads=8, mamba_d_head=8, mamba_d_ssm=64,
              laurel_rank=8)  # fmt: skip


def tiny_config(model_type: str) -> dict:
    """`SIZES` (but a size the family refuses to set), plus the fields of this family's config that must agree with
    them: a head width (8) where the config has one, a rotary width that fits a head, special token ids inside the
    tiny vocabulary, the `WIDTHS` the config has, expert counts its default leaves None, per-layer lists it would keep
    at the default layer count (shortened, one layer of each kind first), fewer kv-sharing layers than the tiny
    model has, `FAMILY_FIELDS`, and each sub-config (a multimodal model's `text_config`, `vision_config`,
    `audio_config`, ...) made tiny the same way (with the `FAMILY_FIELDS` of its own model type), so no part of the
    model keeps its full size."""
    from transformers import CONFIG_MAPPING

    try:
        defaults = CONFIG_MAPPING[model_type]()
    except Exception:  # noqa: BLE001 - the build reports it
        return dict(SIZES)
    sizes = {field: value for field, value in SIZES.items() if _accepts(defaults, field, value)}
    return {**sizes, **_tiny_fields(defaults), **FAMILY_FIELDS.get(model_type, {})}


def _tiny_fields(defaults) -> dict:
    """The fields of one config (`defaults`, a default instance) that `tiny_config` sets beyond `SIZES`; a
    sub-config is given as a dict of only the fields it has, `SIZES` too."""
    from transformers import PretrainedConfig

    config = {}
    head = SIZES["hidden_size"] // SIZES["num_attention_heads"]
    for field, value in (
        ("head_dim", head),
        ("d_head", head),
        ("attention_head_size", head),
        ("rotary_dim", head // 2),
    ):
        if isinstance(_value(defaults, field), int) and _settable(defaults, field):
            config[field] = value
    for field in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(_value(defaults, field), int) and _value(defaults, field) >= VOCAB:
            config[field] = VOCAB - 1
    for field, value in WIDTHS.items():  # fields of its own only: xLSTM's `qk_head_dim` is a read-only property
        if isinstance(vars(defaults).get(field), int):
            config[field] = value
    for field, value in (("num_experts_per_tok", 2), ("n_routed_experts", 4), ("n_shared_experts", 1)):  # dots1
        if field in vars(defaults) and vars(defaults)[field] is None:
            config[field] = value
    config.update(_per_layer_lists(defaults))
    shared = vars(defaults).get("num_kv_shared_layers")  # Gemma 3n: the last layers reuse earlier layers' keys/values
    if isinstance(shared, int) and shared >= SIZES["num_hidden_layers"]:
        config["num_kv_shared_layers"] = SIZES["num_hidden_layers"] - 1  # one layer must still produce them
    if "qk_rope_head_dim" in config:  # latent attention: head_dim is the rotary part of a query/key head
        config["head_dim"] = config["qk_rope_head_dim"]
    for field in getattr(type(defaults), "sub_configs", {}):
        sub = getattr(defaults, field, None)
        if isinstance(sub, PretrainedConfig) and sub.model_type:  # not DBRX's attn_config: part of its parent
            sizes = {key: value for key, value in SIZES.items() if isinstance(_value(sub, key), int)}
            config[field] = {
                "model_type": sub.model_type, **sizes, **_tiny_fields(sub), **FAMILY_FIELDS.get(sub.model_type, {})
            }  # fmt: skip
            if "num_hidden_layers" in sizes and isinstance(_value(sub, "mlp_layer_types"), list):
                # per-layer MLP kinds (dots3's vision tower) are not re-derived from the layer count: keep the first
                config[field]["mlp_layer_types"] = sub.mlp_layer_types[: SIZES["num_hidden_layers"]]
    return config


def _per_layer_lists(defaults) -> dict:
    """Per-layer lists (`layer_types`, Zamba's `layers_block_type`) that the config keeps at its default layer count
    when given the tiny one (a fixed default, or one derived with a fixed prefix), shortened to the tiny count: the
    first layer, then the first of each other kind, so a hybrid keeps an attention and a mixer layer."""
    layers, tiny = _value(defaults, "num_hidden_layers"), SIZES["num_hidden_layers"]
    if not isinstance(layers, int) or layers <= tiny:
        return {}
    try:
        shrunk = vars(type(defaults)(num_hidden_layers=tiny))
    except Exception:  # noqa: BLE001 - its own validation rejects the lists the tiny count leaves
        shrunk = {}
    lists = {}
    for field, value in vars(defaults).items():
        if isinstance(value, (list, tuple)) and len(value) == layers and not field.startswith("_"):
            if len(shrunk.get(field) or ()) != tiny:
                kept = [0]
                for index, kind in enumerate(value):  # == rather than hashing: a kind may be a list
                    if all(kind != value[other] for other in kept):
                        kept.append(index)
                kept = sorted((kept + [i for i in range(layers) if i not in kept])[:tiny])
                lists[field] = type(value)(value[i] for i in kept)
    return lists


def _accepts(config, field: str, value) -> bool:
    """False where the family refuses to set a generic size (ProphetNet's `num_hidden_layers`, XLNet's
    `max_position_embeddings`: properties whose setters raise; PVT's per-stage `num_attention_heads`, a list)."""
    try:
        setattr(copy.deepcopy(config), field, value)
    except Exception:  # noqa: BLE001 - a setter that raises, or a strict field of another type (a list)
        return False
    return True


def _settable(config, field: str) -> bool:
    """False for a read-only property (Falcon's `head_dim`, derived from the sizes)."""
    attribute = getattr(type(config), field, None)
    return not isinstance(attribute, property) or attribute.fset is not None


def _value(config, field: str):
    """`config.field`, or None where it has none; a field some configs keep per layer (Gemma 4's `head_dim`) is read
    from the config's own attributes, since reading it as one value raises."""
    try:
        return getattr(config, field, None)
    except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
        return vars(config).get(field)


def build_family(task: str, family: str, fields: dict | None = None):
    """The family's tiny model for the task (`tp_train.tools.zoo_tasks.build`), from `tiny_config` (a tower's: its
    dual encoder's) with `fields` set."""
    from tp_train.tools.zoo_tasks import build

    return build(task, family, _with_fields(tiny_config(family.split(".")[0]), fields or {}))


def _with_fields(config: dict, fields: dict) -> dict:
    """`config` with `fields` set at its top and in each sub-config (a dict) that has them (a multimodal model's text
    config keeps its own kv heads)."""
    config = {**config, **fields}
    for key, value in config.items():
        if isinstance(value, dict) and key not in fields:
            config[key] = {**value, **{field: fields[field] for field in fields if field in value}}
    return config


def families(task: str = "causal-lm") -> list[str]:
    from tp_train.tools.zoo_tasks import task_families

    return task_families(task)


# ------------------------------------------------------------------------------------------------ one rank


def check_family(model_type: str, steps: int = 3, task: str = "causal-lm", fields: dict | None = None) -> dict:
    """On one rank of an initialised process group: the family's class and what decided it. A family that differs
    beyond the tolerance in float32 is checked again in float64, where summation order no longer shows: matching
    there (within 1e-9) makes it `round-off` (or `unsharded`, when a rank also holds too much of its blocks), not
    `WRONG`. `fields` are set in the family's tiny config (a setting of the run, e.g. its kv heads)."""
    import torch

    result = _check_family(model_type, steps, TOLERANCE, task, fields)
    if result["class"] != "WRONG":
        return result
    default, upcast = torch.get_default_dtype(), torch.Tensor.float
    torch.set_default_dtype(torch.float64)
    # Models that upcast for half precision (`x.float()` in Gemma 4's norms) would drop to float32 here and bring
    # float32's round-off back: in this re-check, `.float()` leaves a float64 tensor as it is.
    torch.Tensor.float = lambda self, *args, **kwargs: (
        self if self.dtype == torch.float64 else upcast(self, *args, **kwargs)
    )
    try:
        exact = _check_family(model_type, steps, 1e-9, task, fields)
    finally:
        torch.set_default_dtype(default)
        torch.Tensor.float = upcast
    if exact["class"] == "pass":
        return {**result, "class": "round-off", "reason": f"float32: {result['reason']}; float64: {exact['reason']}"}
    if exact["class"] == "unsharded":  # the same function, but it holds too much: not WRONG
        return {**exact, "reason": f"float32 round-off ({result['reason']}); float64 {exact['reason']}"}
    return result


def _check_family(model_type: str, steps: int, tolerance: float, task: str, fields: dict | None) -> dict:
    import torch
    import torch.distributed as dist

    import tp_train
    from tp_train.errors import first_line
    from tp_train.tools.zoo_tasks import batches, output_tensor

    torch.manual_seed(0)
    try:
        reference = build_family(task, model_type, fields).eval()
        if hasattr(reference, "set_default_language"):  # X-MOD's adapters need a language, unsharded too
            reference.set_default_language(reference.config.languages[0])
        if not _has_block_linears(reference):
            return {
                "class": "no blocks",
                "reason": "its repeated blocks hold no Linear layer (a convolutional network)",
            }
        steps = batches(task, reference, steps)
        with torch.no_grad():
            if not torch.isfinite(output_tensor(steps[0][0](reference))).all():
                return {"class": "unbuildable", "reason": "the unsharded tiny model's outputs are not finite"}
    except Exception as error:  # noqa: BLE001 - a family this config cannot build is not counted
        return {"class": "unbuildable", "reason": first_line(error)}
    model = copy.deepcopy(reference)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            tp_train.parallelize(model)
    except (ValueError, tp_train.PlanVerificationError) as error:
        return {"class": "refused", "reason": first_line(error)}
    except Exception as error:  # noqa: BLE001
        return {"class": "error", "reason": f"parallelize: {type(error).__name__}: {first_line(error)}"}
    kept_whole = any("kept whole" in line for line in printed.getvalue().splitlines())
    with torch.no_grad():  # as the reference ran before it was copied: a cache an eval forward fills (LeViT's
        steps[0][0](model)  # attention biases) then holds values outside autograd in both
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (reference, model)]
    specs = {name: spec for name, _, spec in tp_train.named_sharded_parameters(model)}
    worst, where = 0.0, ""
    try:
        for step, (inputs, loss_of) in enumerate(steps):
            logits = [output_tensor(inputs(m)) for m in (reference, model)]
            losses = [loss_of(out) for out in logits]
            for loss in losses:
                loss.backward()
            differences = {f"loss at step {step}": (losses[0] - losses[1]).abs().item()}
            if step == 0:
                differences["logits"] = (logits[0] - logits[1]).abs().max().item()
                reference_params = dict(reference.named_parameters())
                share, whole = _block_share(model, reference_params)
                for name, param in model.named_parameters():
                    grad = param.grad
                    if grad is not None and name in specs:
                        grad = tp_train.unshard_tensor(grad, specs[name], dist.group.WORLD)
                    expected = reference_params[name].grad
                    if grad is not None and expected is not None and grad.shape == expected.shape:
                        differences[f"gradient of {name}"] = (grad - expected).abs().max().item()
            for key, value in differences.items():
                if not value <= worst:  # NaN counts as worst
                    worst, where = value, key
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    except Exception as error:  # noqa: BLE001
        return {"class": "error", "reason": f"training step: {type(error).__name__}: {first_line(error)}"}
    if not worst <= tolerance:
        return {"class": "WRONG", "reason": f"{where} differs by {worst:.3g}", "kept_whole": kept_whole}
    tp = dist.get_world_size()
    if not kept_whole and share > UNSHARDED / tp:
        return {
            "class": "unsharded",
            "reason": f"matches (largest difference {worst:.1e}), but a rank holds {share:.2f} of the trained block "
            f"matrices ('{whole}' among those kept whole)",
        }
    sharded = (1 - share) / (1 - 1 / tp)  # the fraction of the block matrices split (a rank holds 1/tp of them)
    if kept_whole and sharded < 1 / tp + KEPT_WHOLE_MARGIN:
        return {
            "class": "unsharded",
            "reason": f"matches (largest difference {worst:.1e}), but with an attention kept whole only {sharded:.2f} "
            f"of the trained block matrices are sharded (a pass shards {1 / tp + KEPT_WHOLE_MARGIN:.2f})",
            "kept_whole": True,
        }
    return {"class": "pass", "reason": f"largest difference {worst:.1e}", "kept_whole": kept_whole}


def _has_block_linears(model) -> bool:
    """Whether a Linear (or Hugging Face Conv1D) lies inside one of `model`'s repeated blocks."""
    from tp_train.plan.coverage import in_block
    from tp_train.plan.styles import linear_shape

    return any(
        linear_shape(module) is not None and in_block(model, f"{name}.weight") for name, module in model.named_modules()
    )


def _block_share(model, reference_params: dict) -> tuple[float, str]:
    """This rank's share of the elements of the block matrices that train (parameters of two or more dims inside a
    repeated block, `in_block`, that holds a Linear, and that got a gradient: a vision tower a text batch never
    reaches does not count, nor a convolutional stem's numbered layers), and the first one it holds whole."""
    from tp_train.plan.coverage import in_block

    held = full = 0
    whole = ""
    for name, param in model.named_parameters():
        expected = reference_params[name]
        if param.dim() >= 2 and expected.grad is not None and in_block(model, name) and _in_linear_block(model, name):
            held, full = held + param.numel(), full + expected.numel()
            whole = whole or (name if param.numel() == expected.numel() else "")
    return held / max(full, 1), whole


def _in_linear_block(model, name: str) -> bool:
    """Whether parameter `name`'s repeated block (its first numbered module) holds a Linear: a transformer block,
    not a numbered convolution of a feature encoder (SpeechT5's) or a stage's patch embedding (PVT's)."""
    from tp_train.plan.styles import linear_shape

    parts = name.split(".")
    index = next(i for i, part in enumerate(parts) if part.isdigit())
    block = model.get_submodule(".".join(parts[: index + 1]))
    return any(linear_shape(module) is not None for module in block.modules())


def _rank_main(model_type: str, case: dict, rank: int, world_size: int, port: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            result = check_family(model_type, **case)
    except BaseException as error:  # noqa: BLE001 - reported as the family's error
        result = {"class": "error", "reason": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
    finally:
        dist.destroy_process_group()
    if rank == 0:
        results.send(result)


# ------------------------------------------------------------------------------------------------ the parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Family:
    """One family's ranks, each a process forked from a server that imported torch and transformers once."""

    def __init__(self, context, model_type: str, case: dict, tp: int, timeout: float, target=None):
        self.model_type, self.deadline, port = model_type, time.monotonic() + timeout, _free_port()
        self.receiver, sender = context.Pipe(duplex=False)
        self.ranks = [
            context.Process(target=target or _rank_main, args=(model_type, case, rank, tp, port, sender), daemon=True)
            for rank in range(tp)
        ]
        for rank in self.ranks:
            rank.start()
        sender.close()

    def result(self) -> dict | None:
        """The family's result once rank 0 sends it (or its ranks die, or the deadline passes), else None. A rank
        killed by a signal the zoo did not send makes it `killed`, whatever rank 0 sent (its collectives failed)."""
        if self.receiver.poll():
            try:
                result = self.receiver.recv()
            except EOFError:
                result = None
            if result is not None:
                return self._killed(self._stop(timeout=10)) or result
        if all(not rank.is_alive() for rank in self.ranks):
            codes = [rank.exitcode for rank in self.ranks]
            return self._killed(codes) or {"class": "error", "reason": f"ranks exited with codes {codes} and no result"}
        if time.monotonic() > self.deadline:
            self._stop(timeout=0)
            return {"class": "error", "reason": "no result within the time limit"}
        return None

    @staticmethod
    def _killed(codes: list) -> dict | None:
        """`killed` when a rank's exit code (None: still running when the zoo stopped it) is a signal's."""
        killed = {rank: -code for rank, code in enumerate(codes) if code is not None and code < 0}
        if not killed:
            return None
        ranks = ", ".join(f"rank {rank} by {signal.Signals(number).name}" for rank, number in killed.items())
        return {"class": "killed", "reason": f"killed: {ranks} (out of memory, if SIGKILL)"}

    def _stop(self, timeout: float) -> list:
        """Each rank's exit code before the zoo stopped it (None for one it had to kill)."""
        codes = []
        for rank in self.ranks:
            rank.join(timeout)
            codes.append(rank.exitcode)
            if rank.is_alive():
                rank.kill()
                rank.join()
        return codes


def run_zoo(
    model_types: list[str],
    tp: int = 2,
    jobs: int = 2,
    timeout: float = 180,
    echo=None,
    task: str = "causal-lm",
    fields: dict | None = None,
    target=None,
) -> dict[str, dict]:
    """{family: result} for each family of `task`, `jobs` families at a time, then each one `killed` again alone;
    `fields` set in every family's tiny config (a setting of the run: its kv heads). `target` runs a rank (tests)."""
    import multiprocessing

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # the ranks' warnings would bury the table
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "tp_train", "models.hf", "tp_train.tools.zoo_tasks"])
    echo = echo or (lambda line: print(line, flush=True))
    case = dict(task=task, fields=fields)
    results = _run_families(model_types, jobs, lambda name: _Family(context, name, case, tp, timeout, target), echo)
    killed = [name for name in model_types if results[name]["class"] == "killed"]
    if killed and jobs > 1:
        echo(f"again, one at a time: {', '.join(killed)}")
        results |= _run_families(killed, 1, lambda name: _Family(context, name, case, tp, timeout, target), echo)
    return results


def _run_families(model_types: list[str], jobs: int, start, echo) -> dict[str, dict]:
    """{family: result}, `jobs` families at a time, each started by `start(family)` (a `_Family`)."""
    pending, running, results = list(model_types), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            running.append(start(pending.pop(0)))
        for family in list(running):
            result = family.result()
            if result is not None:
                running.remove(family)
                results[family.model_type] = result
                echo(f"{family.model_type:<28} {result['class']:<11} {result['reason']}")
        time.sleep(0.2)
    return results


def summary(results: dict[str, dict], tp: int) -> str:
    """The README's table: counts per class, then every family not passing, with its reason."""
    counts = {name: sum(r["class"] == name for r in results.values()) for name in CLASSES}
    buildable = len(results) - sum(counts[name] for name in NOT_COUNTED)
    partial = sorted(name for name, r in results.items() if r["class"] == "pass" and r.get("kept_whole"))
    share = counts["pass"] / max(buildable, 1)
    lines = [
        f"{counts['pass']} of {buildable} buildable families pass at tp={tp} ({share:.0%}); "
        f"round-off {counts['round-off']}, refused {counts['refused']}, WRONG {counts['WRONG']}, "
        f"killed {counts['killed']}, error {counts['error']}, unsharded {counts['unsharded']}; "
        f"{counts['unbuildable']} not buildable from a tiny config"
        + (f", {counts['no blocks']} with no Linear in their blocks" if counts["no blocks"] else ""),
    ]
    if partial:
        lines.append(f"pass with attention kept whole ({len(partial)}): {', '.join(partial)}")
    for name in ("WRONG", "round-off", "unsharded", "refused", "killed", "error", "unbuildable", "no blocks"):
        for family, result in sorted(results.items()):
            if result["class"] == name:
                lines.append(f"{name:<8} {family:<26} {result['reason']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from tp_train.tools.zoo_tasks import TASKS

    parser = argparse.ArgumentParser(prog="python -m tp_train.tools.zoo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="causal-lm", choices=[*TASKS, "all"], help="which families (default: LMs)")
    parser.add_argument("--families", help="comma-separated model types (default: every family of the task)")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--jobs", type=int, default=2, help="families checked at once")
    parser.add_argument("--timeout", type=float, default=180, help="seconds per family")
    parser.add_argument("--output", help="write the results as JSON here ({task: results} with --task all)")
    parser.add_argument(
        "--kv-heads", type=int, help=f"kv heads of every family that has them (default: as many as the "
        f"{SIZES['num_attention_heads']} query heads; 2 is grouped-query attention)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    fields = {"num_key_value_heads": args.kv_heads} if args.kv_heads else None
    tasks = list(TASKS) if args.task == "all" else [args.task]
    everything = {}
    for task in tasks:
        chosen = args.families.split(",") if args.families else families(task)
        started = time.monotonic()
        everything[task] = run_zoo(chosen, args.tp, args.jobs, args.timeout, task=task, fields=fields)
        print(f"\n{task}: {summary(everything[task], args.tp)}\n({time.monotonic() - started:.0f} s)", flush=True)
    if args.output:
        with open(args.output, "w") as file:
            json.dump(everything if args.task == "all" else everything[args.task], file, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
