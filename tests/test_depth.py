"""A deep model simulated from shallow builds of it (`tp_train.tools.depth`), and `tp-train-plan`, which plans a cluster
with it on fake ranks in one process: the line through two and three blocks a stage lands on the whole simulation,
count by count, without a pipeline and at an uneven pipeline split; the command's table and its one-line refusals."""

from __future__ import annotations

import json
from functools import partial

import pytest

from models import GPT, GPTConfig
from tp_train.app.plan_cluster import main, plan, token_count
from tp_train.parallel.dims import ParallelDims
from tp_train.tools.depth import Depth, simulate_at_depth
from tp_train.tools.simulate import simulate_step
from tp_train.tools.steps import language_model_step
from tp_train.training.apply_order import TrainingOptions

SEQ, VOCAB = 32, 256


def _gpt(blocks: int) -> GPT:
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=blocks, n_head=4, n_embd=64, dropout=0.0))


def _counts(step) -> tuple:
    collectives = {(key.kind, key.role, key.ranks): (c.calls, c.bytes) for key, c in step.collectives.items()}
    return step.memory, step.flops, step.operations, step.memory_traffic, collectives


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, tp, pp, mode, blocks, checkpointing",
    [(4, 2, 1, "fsdp", 5, False), (2, 1, 2, "ddp", 9, True)],
    ids=["tp2-fsdp2-5-blocks", "pp2-9-blocks-uneven-split"],
)
def test_the_line_through_two_and_three_blocks_a_stage_is_the_whole_simulation(
    world, tp, pp, mode, blocks, checkpointing
):
    dims = ParallelDims.from_world(world, tp=tp, pp=pp, data_parallel=mode)
    options = TrainingOptions(
        loss_parallel=True, data_parallel=mode, activation_checkpointing=checkpointing,
        pipeline_microbatches=2 if pp > 1 else None,
    )  # fmt: skip
    step = language_model_step(2, SEQ, VOCAB)
    for rank in [0] if pp == 1 else [0, world - 1]:
        whole = simulate_step(partial(_gpt, blocks), dims, step, options, rank)
        line = simulate_at_depth(Depth(_gpt, blocks), dims, step, options, rank)
        assert _counts(line) == _counts(whole), rank


def test_stages_the_real_blocks_cannot_hold_are_refused_before_any_simulation():
    dims = ParallelDims.from_world(4, pp=4)
    with pytest.raises(ValueError, match="4 stages .* has 3 blocks"):
        simulate_at_depth(Depth(_gpt, 3, "GPT's blocks"), dims, language_model_step(4, SEQ, VOCAB))


@pytest.fixture
def llama_config(tmp_path):
    path = tmp_path / "config.json"
    fields = {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64,
    }  # fmt: skip
    path.write_text(json.dumps(fields))
    return path


@pytest.mark.slow
def test_plan_prints_the_layouts_of_a_cluster_from_a_hugging_face_config(llama_config):
    table = plan([
        "--model", str(llama_config), "--devices", "8", "--devices-per-node", "4", "--hardware", "h100-80gb",
        "--seq-len", "32", "--global-batch-tokens", "128", "--tp", "2", "--pp", "2", "--data-parallel", "ddp",
    ])  # fmt: skip
    lines = table.splitlines()
    assert lines[0].startswith("tp-train-plan: 8 devices (2 nodes), 67.06 GiB usable each, h100-80gb; 8 blocks")
    assert "4 x 32 tokens a step" in lines[0]
    assert lines[2].startswith("tp=2 pp=2 dp=2 ddp 1f1b x2 "), table  # a micro-batch of 2 sequences, 2 microbatches
    # the interleaved schedule's 4 stages do not divide a rank's 2 sequences: said, not simulated
    assert "cannot shard this model: tp=2 pp=2 dp=2 ddp interleaved_1f1b" in table


def test_a_conf_model_plans_with_its_overrides():
    table = plan([
        "--model", "gpt_tiny", "model.config.n_layer=4", "--devices", "2", "--hardware", "cpu-2core",
        "--seq-len", "64", "--global-batch-tokens", "128", "--tp", "1", "--pp", "2",
    ])  # fmt: skip
    assert "4 blocks, 2 x 64 tokens a step" in table.splitlines()[0]
    assert "tp=1 pp=2 dp=1 1f1b" in table


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--hardware", "tpu-v9"], "hardware='tpu-v9' is not a known profile; use one of h100-80gb"),
        (["--global-batch-tokens", "1000"], "(1000 tokens) is not a whole number of --seq-len=32 sequences"),
        (["--global-batch-tokens", "4X"], "--global-batch-tokens=4X: give a positive count of tokens"),
        (["--model", "nonesuch"], "--model=nonesuch: neither a config.json nor a model of conf/model"),
        (["--devices", "12"], "--devices=12 --devices-per-node=8: give a whole number of nodes"),
    ],
)
def test_bad_input_is_one_line_and_status_2(llama_config, capsys, arguments, message):
    given = {
        "--model": str(llama_config), "--devices": "8", "--hardware": "h100-80gb", "--seq-len": "32",
        "--global-batch-tokens": "1K",
    }  # fmt: skip
    given.update(zip(arguments[::2], arguments[1::2], strict=True))
    with pytest.raises(SystemExit) as stopped:
        main([item for pair in given.items() for item in pair])
    assert stopped.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("tp-train-plan: ") and message in error and len(error.strip().splitlines()) == 1


def test_token_counts_take_binary_suffixes():
    assert token_count("4M") == 4 * 2**20 and token_count("8k") == 8192 and token_count("524288") == 524288


# Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (2021), Table 1:
# (hidden size, layers, attention heads, tensor-parallel size, pipeline-parallel size); vocabulary 51,200 and
# sequences of 2048, as the paper's GPT models.
MEGATRON_PUBLISHED = {"175B": (12288, 96, 96, 8, 16)}  # 1T (25600, 128, 160, 8, 64) too, by hand: docs


@pytest.mark.slow
@pytest.mark.parametrize("name", MEGATRON_PUBLISHED)
def test_the_parameters_a_rank_holds_at_megatrons_published_layouts_are_megatrons_formulas(name):
    """The first pipeline rank's parameters, simulated from shallow builds, against Megatron-LM's own count of its most
    loaded shard (`theoretical_memory_usage.py`: (the layers' parameters / pp + the embedding) / tp, with 12h^2 + 4h a
    layer). Ours adds what that count leaves out: the learned positions and the linears' biases, and the LayerNorms and
    row-parallel biases that tensor parallelism replicates rather than splits."""
    hidden, layers, heads, tp, pp = MEGATRON_PUBLISHED[name]
    vocab, seq = 51200, 2048

    def gpt(blocks: int) -> GPT:
        return GPT(GPTConfig(vocab_size=vocab, block_size=seq, n_layer=blocks, n_head=heads, n_embd=hidden))

    dims = ParallelDims.from_world(tp * pp, tp=tp, pp=pp)
    options = TrainingOptions(loss_parallel=True, pipeline_microbatches=pp, pipeline_split=(layers // pp,) * pp)
    step = simulate_at_depth(Depth(gpt, layers), dims, language_model_step(pp, 64, vocab), options, rank=0)
    held = step.memory.parameters // 4  # fp32
    blocks = layers // pp
    # per block: the weights 12h^2 and the column-parallel biases 7h split; the row-parallel biases 2h and the two
    # LayerNorms' 4h whole on every rank
    ours = blocks * ((12 * hidden**2 + 7 * hidden) // tp + 6 * hidden) + vocab * hidden // tp + seq * hidden
    assert held == ours
    megatron = (layers * (12 * hidden**2 + 4 * hidden) / pp + vocab * hidden) / tp
    without_positions = held - seq * hidden
    assert abs(without_positions / megatron - 1) < 5e-4, (held, megatron)
