"""`numerics="invariant"` (issue 57): training whose bits do not depend on the tensor-parallel degree.

The oracle is `torch.equal`, not a tolerance: our GPT in fp32, 10 AdamW steps through `parallelize_for_training`,
the vocabulary-parallel loss and the clipping norm, at tp 2 and 4 against tp 1 in the same mode (the unsharded model,
its layers in the same tiles): every loss, every gradient norm and every final parameter equal bit for bit; and
`python train.py numerics=invariant` at tp=2 against tp=1, through Lightning (its logged series, the checkpoint's
weights). The same in-process run in `numerics="fast"` is not equal (the check can fail), and the primitives' claims
about this machine's kernels are checked one by one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from tests import train_cases
from tests.distributed import run_on_ranks
from tests.test_pipeline_train import _metrics
from tp_train.parallel import invariant
from tp_train.tools.export import export_lightning

ROOT = Path(__file__).resolve().parents[1]

STEPS = 10
VOCAB = 128  # a multiple of 4 (no padding) and of invariant.MAX_SPLIT
SEQ, BATCH = 32, 8  # the global batch: 8 leaves of one sample


def _train(rank, world_size, numerics, steps, tp, autocast=None):
    import models.gpt as gpt
    from tp_train import ParallelDims
    from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
    from tp_train.parallel.sharding import full_state_dict
    from tp_train.training.apply_order import TrainingOptions, parallelize_for_training

    torch.manual_seed(0)
    config = gpt.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64, dropout=0.0)
    model = gpt.GPT(config)
    dims = ParallelDims.from_world(world_size, tp=tp)
    mesh = dims.build_mesh("cpu")
    options = TrainingOptions(loss_parallel=True, verify_plan=False, numerics=numerics)
    training = parallelize_for_training(model, dims, mesh, torch.device("cpu"), options)
    group = mesh.tensor_parallel.get_group()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.Generator().manual_seed(1)
    replica = mesh.replicas.get_local_rank()

    def loss_of(samples):  # under autocast where given, as Lightning's mixed precision runs forward and loss
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = training.module(samples[:, :-1])
            return vocab_parallel_cross_entropy(logits, samples[:, 1:], group, VOCAB, numerics=numerics)

    losses, norms = [], []
    for _ in range(steps):
        batch = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=data)  # the global batch: each replica's share
        mine = batch[replica :: dims.dp]  # as Lightning's DistributedSampler deals a global batch
        if numerics == "invariant":
            loss = training.backward_in_leaves(mine, loss_of)
        else:
            loss = loss_of(mine)
            loss.backward()
        training.after_backward()
        norms.append(training.clipping().clip_(model.parameters(), 1.0))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach().clone())
    return torch.stack([torch.stack(losses), torch.stack(norms).to(torch.float32)]), full_state_dict(model, group)


def _runs(numerics: str, layouts=((1, 1), (2, 1), (4, 1)), steps: int = STEPS, autocast=None) -> dict[tuple, tuple]:
    """(tp, dp) -> (losses and norms, the final parameters), as rank 0 returns them."""
    return {(tp, dp): run_on_ranks(_train, tp * dp, numerics, steps, tp, autocast)[0] for tp, dp in layouts}


def _differences(runs: dict[tuple, tuple], layout: tuple) -> list[str]:
    (losses, state), (base_losses, base_state) = runs[layout], runs[1, 1]
    unequal = [] if torch.equal(losses, base_losses) else ["losses"]
    return unequal + [name for name, value in base_state.items() if not torch.equal(state[name], value)]


@pytest.mark.slow
def test_gpt_trains_to_the_same_bits_at_every_tensor_and_data_parallel_degree():
    layouts = ((2, 1), (4, 1), (1, 2), (1, 4), (2, 2))  # (tp, dp)
    runs = _runs("invariant", ((1, 1), *layouts))
    for layout in layouts:
        assert _differences(runs, layout) == [], layout


@pytest.mark.slow
def test_under_bf16_autocast_too():
    layouts = ((2, 1), (1, 2))
    runs = _runs("invariant", ((1, 1), *layouts), autocast=torch.bfloat16)
    for layout in layouts:
        assert _differences(runs, layout) == [], layout
    fast = _runs("fast", ((1, 1),), steps=STEPS, autocast=torch.bfloat16)[1, 1][0]
    assert torch.allclose(runs[1, 1][0], fast, rtol=0, atol=0.05)  # as close to the fast mode as bf16 allows


def test_fast_numerics_differ_in_the_last_bits_so_the_check_can_fail():
    runs = _runs("fast", ((1, 1), (2, 1)), steps=2)
    differences = _differences(runs, (2, 1))
    assert differences, "fast numerics matched bit for bit: the invariant test above would prove nothing"
    assert torch.allclose(runs[2, 1][0], runs[1, 1][0], rtol=0, atol=1e-5)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_contraction_split_over_ranks_sums_to_the_whole_trees_bits(ranks):
    torch.manual_seed(0)
    a, b = torch.randn(40, 128), torch.randn(128, 48)
    share = 128 // ranks
    sizes = (40, 128, 48)  # global: the leaves are 128 / 8 wide, each rank's a subtree
    parts = [
        invariant.matmul(a[:, r * share : (r + 1) * share], b[r * share : (r + 1) * share], sizes) for r in range(ranks)
    ]
    assert torch.equal(invariant.tree_sum(torch.stack(parts)), invariant.matmul(a, b, sizes))
    assert not torch.equal(sum(part for part in parts), invariant.matmul(a, b, sizes)) or ranks == 2


def test_a_column_tile_gives_the_same_bits_whatever_columns_surround_it():
    torch.manual_seed(0)
    a, b = torch.randn(64, 64), torch.randn(64, 96)
    sizes = (64, 64, 96)  # tiles of 4 columns
    whole = invariant.matmul(a, b, sizes)
    assert torch.equal(invariant.matmul(a, b[:, 32:64], sizes), whole[:, 32:64])  # a column shard
    assert torch.equal(invariant.matmul(a, b[:, 84:], sizes), whole[:, 84:])  # the last three tiles


def test_a_plain_sum_split_over_ranks_sums_to_the_whole_sums_bits():
    torch.manual_seed(0)
    x = torch.randn(5, 96) * 1e3
    halves = torch.stack([invariant.row_sum(x[:, :48], 96), invariant.row_sum(x[:, 48:], 96)])
    assert torch.equal(invariant.tree_sum(halves), invariant.row_sum(x, 96))
    assert torch.allclose(invariant.row_sum(x, 96), x.double().sum(1).float(), rtol=1e-6)


def test_the_tree_halves_the_terms_rather_than_adding_them_in_turn():
    p = torch.tensor([1e8, 1.0, -1e8, 1.0], dtype=torch.float32).reshape(4, 1)
    assert torch.equal(invariant.tree_sum(p), (p[0] + p[1]) + (p[2] + p[3]))  # 0 in float32
    assert not torch.equal(invariant.tree_sum(p), ((p[0] + p[1]) + p[2]) + p[3])  # 1


def test_the_kernels_the_rules_rely_on_give_a_shards_bits():
    """docs/invariant-numerics.md, rule 9, on this machine's kernels at the widths tensor parallelism makes: element-
    wise functions on a column shard, attention on a shard of the heads, AdamW on a shard of a weight."""
    torch.manual_seed(0)
    x = torch.randn(64, 768)
    functions = [torch.exp, torch.erf, torch.tanh, torch.nn.functional.gelu, torch.nn.functional.silu]
    for function in functions:
        for width in (96, 192, 384):  # 768 over tp 8, 4, 2
            assert torch.equal(function(x[:, :width].contiguous()), function(x)[:, :width]), (function, width)
    q, k, v = (torch.randn(2, 8, 32, 16) for _ in range(3))
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    half = torch.nn.functional.scaled_dot_product_attention(*(t[:, 4:].contiguous() for t in (q, k, v)), is_causal=True)
    assert torch.equal(half, whole[:, 4:])
    weight = torch.nn.Parameter(torch.randn(64, 96))
    shard = torch.nn.Parameter(weight.detach()[:32].clone())
    optimizers = [torch.optim.AdamW([weight], lr=1e-2), torch.optim.AdamW([shard], lr=1e-2)]
    for _ in range(3):
        gradient = torch.randn(64, 96)
        weight.grad, shard.grad = gradient, gradient[:32].clone()
        for optimizer in optimizers:
            optimizer.step()
    assert torch.equal(shard.detach(), weight.detach()[:32])


@pytest.mark.parametrize(
    ("size", "ranks", "says"),
    [(96, 3, "over 1, 2, 4 or 8 ranks; got 3"), (100, 2, "multiple of 8; 100 is not"), (64, 16, "got 16")],
)
def test_a_split_that_cuts_a_tile_is_refused_in_one_line(size, ranks, says):
    with pytest.raises(ValueError, match=says) as error:
        invariant.check_split(size, ranks, "'blocks.0.mlp.proj'")
    assert "\n" not in str(error.value) and "blocks.0.mlp.proj" in str(error.value)


def _train_py(tmp_path: Path, name: str, layout: list[str], resume: Path | None = None):
    """The logged series of `python train.py experiment=smoke numerics=invariant <layout>` (10 steps of a global batch
    of 8, clipped at 1.0 by the default config, a checkpoint at step 5 and 10), resumed from `resume` where given,
    and its final weights, whole, from its checkpoint."""
    out = tmp_path / name.replace("=", "").replace(".", "_")
    overrides = ["experiment=smoke", "numerics=invariant", "logger=csv", *layout, f"ckpt_path={resume or 'null'}",
                 "trainer.max_steps=10", "trainer.val_check_interval=5", "trainer.limit_val_batches=1",
                 "trainer.log_every_n_steps=1", "data.max_files=20", "+callbacks.checkpoint.save_top_k=-1",
                 f"hydra.run.dir={out}"]  # fmt: skip
    # Lightning's threads, as a user gets them (one process: the cores; the suite's OMP_NUM_THREADS=1 would hide it)
    env = {key: value for key, value in os.environ.items() if key != "OMP_NUM_THREADS"}
    env.update(WANDB_MODE="offline", TP_TRAIN_CACHE=str(tmp_path / "cache"))
    command = [sys.executable, "train.py", *overrides]
    result = train_cases.run(command, cwd=ROOT, env=env, timeout=300, child_ranks=3)
    assert result.returncode == 0, result.stderr[-4000:]
    whole = export_lightning(out / "checkpoints" / "step000010.ckpt", out / "whole.ckpt")
    return _metrics(out), torch.load(whole, weights_only=False)["state_dict"]


ONE, TP2, DP2 = ["tp=1", "data.batch_size=8"], ["tp=2", "data.batch_size=8"], ["tp=1", "dp=2", "data.batch_size=4"]


def _unequal(weights: dict, reference: dict) -> list[str]:
    assert weights.keys() == reference.keys()
    return [name for name, value in reference.items() if not torch.equal(weights[name], value)]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "layouts"),
    [([], (TP2, DP2)), (["model=hf", "model.type=llama"], (TP2, DP2)), (["model=hf", "model.type=qwen2"], (TP2, DP2))],
)  # fmt: skip
def test_train_py_at_tp2_and_dp2_logs_and_saves_the_bits_of_one_process(tmp_path, model, layouts):
    one, one_weights = _train_py(tmp_path, "one", model + ONE)
    assert one.keys() == {"train/loss", "train/grad_norm", "val/loss"} and len(one["train/loss"]) == 10
    if not model:  # our GPT's first gradients are above the default clip (1.0): the clipped steps are compared
        assert max(one["train/grad_norm"].values()) > 1.0
    for layout in layouts:
        series, weights = _train_py(tmp_path, "_".join(layout), model + layout)
        trained = {key: series[key] for key in ("train/loss", "train/grad_norm")}
        assert trained == {key: one[key] for key in trained}, layout  # every logged value, exactly
        if layout == TP2:  # the same tokens on every rank: the validation loss too
            assert series["val/loss"] == one["val/loss"]
        assert _unequal(weights, one_weights) == [], layout
    if not model:  # tp=2's checkpoint at step 5, resumed in one process, goes on with the same bits
        saved = tmp_path / "_".join(TP2).replace("=", "").replace(".", "_") / "checkpoints" / "step000005.ckpt"
        resumed, resumed_weights = _train_py(tmp_path, "resumed", model + ONE, saved)
        assert resumed["train/loss"] == {step: loss for step, loss in one["train/loss"].items() if step >= 5}
        assert resumed["val/loss"] == {step: loss for step, loss in one["val/loss"].items() if step >= 5}
        assert _unequal(resumed_weights, one_weights) == []


def _refusals(rank, world_size):
    import torch.distributed as dist
    import torch.nn as nn

    import models.gpt as gpt
    from tp_train import ParallelDims
    from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
    from tp_train.parallel.layers import ColumnParallelLinear
    from tp_train.plan.parallelize import _configure_invariant, parallelize
    from tp_train.training.apply_order import TrainingOptions, parallelize_for_training

    group = dist.group.WORLD
    found = {}
    dims = ParallelDims.from_world(world_size, tp=1)  # dp=2
    gpt_model = gpt.GPT(gpt.GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=1, n_head=2, n_embd=32))
    options = TrainingOptions(verify_plan=False, numerics="invariant")
    training = parallelize_for_training(gpt_model, dims, dims.build_mesh("cpu"), torch.device("cpu"), options)
    gpt_model(torch.zeros(1, 4, dtype=torch.long)).sum().backward()
    try:
        training.after_backward()  # a plain backward: each replica's own gradients
    except RuntimeError as error:
        found["plain backward"] = str(error)
    for name, value in {
        "fsdp": lambda: parallelize_for_training(
            gpt.GPT(gpt_model.config), dims, dims.build_mesh("cpu"), torch.device("cpu"),
            TrainingOptions(verify_plan=False, numerics="invariant", data_parallel="fsdp"),
        ),
    }.items():  # fmt: skip
        try:
            value()
        except ValueError as error:
            found[name] = str(error)
    model = nn.Sequential(ColumnParallelLinear(32, 96, group, sections=(32, 32, 32)))  # a fused q, k, v
    for name, call in {
        "sections": lambda: _configure_invariant(model, group),
        "sequence parallel": lambda: parallelize(nn.Linear(4, 4), group, sequence_parallel=True, numerics="invariant"),
        "vocabulary": lambda: vocab_parallel_cross_entropy(
            torch.zeros(3, 50), torch.zeros(3, dtype=torch.long), group, 100, numerics="invariant"
        ),
    }.items():
        try:
            call()
        except ValueError as error:
            found[name] = str(error)
    return found


def test_what_invariant_numerics_does_not_cover_is_refused_in_one_line():
    from tp_train import TensorParallelStrategy

    found = run_on_ranks(_refusals, 2)[0]
    assert "'0' (ColumnParallelLinear)" in found["sections"] and "one section" in found["sections"]
    assert "does not cover sequence_parallel" in found["sequence parallel"]
    assert "multiple of 8; 100 is not" in found["vocabulary"]
    assert "sums the gradients over the replicas in ParallelTraining.backward_in_leaves" in found["plain backward"]
    assert "not dp=2 with data_parallel=fsdp; use numerics='fast'" in found["fsdp"]
    with pytest.raises(ValueError, match=r"fused_loss=True\) with numerics='invariant'") as error:
        TensorParallelStrategy(fused_loss=True, numerics="invariant")
    found["fused"] = str(error.value)
    with pytest.raises(ValueError, match="numerics='exact'; use one of fast, invariant") as error:
        TensorParallelStrategy(numerics="exact")
    found["unknown"] = str(error.value)
    assert all("\n" not in message for message in found.values()), found
