"""Pipeline parallelism without Lightning: where a model splits (tp_train.training.pipeline_split), a stage keeps the
model's parameter names, and our GPT at pp=2 over 10 optimizer steps equals one process (losses and final parameters to
1e-5) with each schedule, on real gloo ranks."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from models.gpt import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tp_train.parallel.pipeline import REFUSED, Pipeline, schedule_named
from tp_train.parallel.pipeline.stage import cut_stage
from tp_train.training.pipeline_split import plan_pipeline_split

STEPS = 10
BATCH, SEQ, VOCAB = 4, 8, 64


def tiny_gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=n_layer, n_head=2, n_embd=32, dropout=0.0))


def batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(ids, targets) per step; targets padded (ignored) unevenly across the batch's rows, so a mean of the
    microbatches' means would differ from the batch's mean."""
    generator = torch.Generator().manual_seed(7)
    out = []
    for step in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
        targets[0, 2 + step % 3 :] = -100
        targets[3, 5:] = -100
        out.append((ids, targets))
    return out


def test_split_balances_parameters_with_embedding_and_head():
    split = plan_pipeline_split(tiny_gpt(5), 2)
    assert split.blocks == "blocks" and split.before == ("tok_emb", "pos_emb") and split.after == ("ln_f", "lm_head")
    assert split.stages == ((0, 1), (2, 3, 4))  # the embedding outweighs the head: the first stage takes fewer
    assert plan_pipeline_split(tiny_gpt(5), 2, explicit=[4, 1]).stages == ((0, 1, 2, 3), (4,))
    assert [len(s) for s in plan_pipeline_split(tiny_gpt(4), 4).stages] == [1, 1, 1, 1]
    model = tiny_gpt(5)
    model.pipeline_split = [1, 4]  # the model's own split, as data beside its tp_plan
    assert plan_pipeline_split(model, 2).stages == ((0,), (1, 2, 3, 4))
    assert plan_pipeline_split(model, 2, explicit=[3, 2]).stages == ((0, 1, 2), (3, 4))  # the argument wins


def test_split_refuses_in_one_line():
    with pytest.raises(ValueError, match=r"3 stages .* GPT's 'blocks' has 2 blocks; use at most 2") as error:
        plan_pipeline_split(tiny_gpt(2), 3)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match=r"pipeline_split=\[2, 2\]: give 2 positive block counts"):
        plan_pipeline_split(tiny_gpt(3), 2, explicit=[2, 2])
    with pytest.raises(ValueError, match="no repeated blocks found in Sequential") as error:
        plan_pipeline_split(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), 2)
    assert "\n" not in str(error.value)


def test_schedules_checked_in_one_line():
    assert not REFUSED  # every schedule torch exports runs here (test_pipeline_equals_one_process)
    with pytest.raises(ValueError, match="places exactly 2 stages per rank in a V"):
        schedule_named("zbv_zero_bubble", 3)
    with pytest.raises(ValueError, match="set pipeline_virtual_stages to 2 or more"):
        schedule_named("interleaved_1f1b", 1)
    with pytest.raises(ValueError, match="is unknown"):
        schedule_named("zigzag", 1)


def test_stages_keep_the_model_names():
    model = tiny_gpt(5)
    split = plan_pipeline_split(model, 2)
    names = [set(dict(cut_stage(copy.deepcopy(model), split, s).named_parameters())) for s in range(2)]
    assert "blocks.2.attn.q.weight" in names[1] and "blocks.2.attn.q.weight" not in names[0]
    assert "tok_emb.weight" in names[0] and "lm_head.weight" in names[1]  # the tied pair: one copy per end
    everything = set(dict(model.named_parameters(remove_duplicate=False)))
    assert names[0] | names[1] == everything and not (names[0] & names[1])


def _train_pipeline(rank, world_size, n_layer, schedule, microbatches, virtual):
    model = tiny_gpt(n_layer)
    split = plan_pipeline_split(model, world_size * virtual)
    pipe = Pipeline(model, split, dist.group.WORLD, schedule, microbatches, torch.device("cpu"))
    optimizer = torch.optim.SGD(list(pipe.parameters()), lr=0.1, momentum=0.9)
    losses = []
    for ids, targets in batches():
        optimizer.zero_grad()
        losses.append(pipe.train_step(ids, targets).item())
        optimizer.step()
    params = {name: p.detach().clone() for m in pipe.models for name, p in m.named_parameters(remove_duplicate=False)}
    return losses, params


def _errors(n_layer, results):
    reference = tiny_gpt(n_layer)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_losses = []
    for ids, targets in batches():
        optimizer.zero_grad()
        loss = F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten(), ignore_index=-100)
        loss.backward()
        optimizer.step()
        reference_losses.append(loss.item())
    loss_error = max(abs(a - b) for losses, _ in results for a, b in zip(losses, reference_losses, strict=True))
    expected = dict(reference.named_parameters(remove_duplicate=False))
    seen: set[str] = set()
    param_error = 0.0
    for _, params in results:
        for name, value in params.items():
            param_error = max(param_error, (value - expected[name]).abs().max().item())
            seen.add(name)
    assert seen == set(expected), f"parameters no stage returned: {set(expected) - seen}"
    pairs = zip(tiny_gpt(n_layer).parameters(), reference.parameters(), strict=True)
    moved = max((p - q).abs().max().item() for p, q in pairs)
    assert moved > 1e-2  # the steps changed the weights: equal parameters are not untrained ones
    return loss_error, param_error


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule,n_layer,microbatches,virtual,pp",
    [
        ("gpipe", 3, 2, 1, 2),
        ("1f1b", 3, 4, 1, 2),
        ("1f1b", 2, 2, 1, 2),
        ("1f1b", 5, 4, 1, 4),  # four stages, uneven (5 blocks), the tie across the first and last
        ("interleaved_1f1b", 5, 2, 2, 2),
        ("looped_bfs", 4, 4, 2, 2),
        ("interleaved_zero_bubble", 4, 4, 2, 2),
        ("zbv_zero_bubble", 4, 4, 2, 2),
        ("dualpipev", 5, 4, 2, 2),
    ],
)
def test_pipeline_equals_one_process(schedule, n_layer, microbatches, virtual, pp):
    results = run_on_ranks(_train_pipeline, pp, n_layer, schedule, microbatches, virtual, timeout=180)
    loss_error, param_error = _errors(n_layer, results)
    print(
        f"{schedule} pp={pp} v={virtual} blocks={n_layer} m={microbatches}: loss {loss_error:.2e} "
        f"param {param_error:.2e}"
    )
    assert loss_error < 1e-5 and param_error < 1e-5
