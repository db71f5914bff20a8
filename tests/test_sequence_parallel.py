"""Sequence parallelism and activation checkpointing compute the same function as the unsharded model (logits,
every gradient, losses over steps) at tp 2 and 4; SP trades each block's all-reduces for all-gathers and
reduce-scatters; norm gradients are summed over the group; a recomputed block replays its dropout masks; and a
real Lightning Trainer with both trains like one device."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks
from tests.parity import assert_parity, full_tensors, parity_errors
from tests.test_parallelize import VOCAB, SwiGLUModel, _gpt, _hf_gpt2, _hf_llama, _hf_logits, _logits

ATOL = 1e-5
MODELS = {"gpt": (_gpt, _logits), "hf_llama": (_hf_llama, _hf_logits)}
MODES = {
    "sequence_parallel": dict(sequence_parallel=True),
    "activation_checkpointing": dict(activation_checkpointing=True),
    "both": dict(sequence_parallel=True, activation_checkpointing=True),
}


def _parity(rank, world_size, modes):
    results = {}
    for model_name, (build, forward) in MODELS.items():
        for mode in modes:
            torch.manual_seed(0)
            results[model_name, mode] = parity_errors(build(), forward, VOCAB, parallelize_kwargs=MODES[mode])
    return results


# SP and AC at tp 2 and 4; both together at tp=2 (the time budget).
CASES = [(tp, model, mode) for tp in (2, 4) for model in MODELS for mode in MODES if tp == 2 or mode != "both"]


@functools.cache
def _parity_run(tp: int):
    """One spawn per tp runs every model and mode (spawning ranks dominates the cost)."""
    return run_on_ranks(_parity, tp, sorted({mode for t, _, mode in CASES if t == tp}), timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("tp,model_name,mode", CASES, ids=["-".join(map(str, case)) for case in CASES])
def test_matches_unsharded(tp, model_name, mode):
    for rank, results in enumerate(_parity_run(tp)):
        assert_parity(results[model_name, mode], tp, rank, ATOL)


def _doge_sequence_parallel(rank, world_size):
    from tests.test_planner_families import VOCAB as ZOO_VOCAB
    from tests.test_planner_families import _doge

    torch.manual_seed(0)
    model = _doge(attention_bias=True)
    return parity_errors(model, _hf_logits, ZOO_VOCAB, parallelize_kwargs=MODES["sequence_parallel"])


@pytest.mark.slow
def test_a_row_layer_keeping_its_heads_output_stays_whole_along_the_sequence():
    """Doge's dt_proj (`rowwise_scatter_output`) reads the values of the attention's gathered input and feeds its
    heads' masks: under sequence parallelism it keeps the whole sequence and only its heads' features."""
    for rank, errors in enumerate(run_on_ranks(_doge_sequence_parallel, 2, timeout=240)):
        assert_parity(errors, 2, rank, ATOL)


# ------------------------------------------------------------------------------------------------ collectives


class _CollectiveCounter:
    """Counts the collectives tp_train.parallel.collectives issues, by kind: the single-tensor all-gather and
    reduce-scatter it calls, and torch.distributed.all_reduce."""

    def __init__(self):
        import tp_train.parallel.collectives as comm

        self.where = {
            "all_gather": (comm, "all_gather_single"),
            "reduce_scatter": (comm, "reduce_scatter_single"),
            "all_reduce": (dist, "all_reduce"),
        }
        self.counts = dict.fromkeys(self.where, 0)
        self.originals = {}

    def __enter__(self):
        for kind, (owner, attribute) in self.where.items():
            original = self.originals[kind] = getattr(owner, attribute)

            def counting(*args, kind=kind, original=original, **kwargs):
                self.counts[kind] += 1
                return original(*args, **kwargs)

            setattr(owner, attribute, counting)
        return self

    def __exit__(self, *exc):
        for kind, (owner, attribute) in self.where.items():
            setattr(owner, attribute, self.originals[kind])


def _count(fn, *args):
    with _CollectiveCounter() as counter:
        result = fn(*args)
    return counter.counts, result


def _collective_counts(rank, world_size):
    out = {}
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        model = tp_train.parallelize(_gpt(), sequence_parallel=sequence_parallel)
        idx = torch.randint(0, VOCAB, (2, 16))
        out[sequence_parallel, "forward"], logits = _count(model, idx)
        out[sequence_parallel, "backward"], _ = _count(logits.sum().backward)
    return out


@pytest.mark.slow
def test_sequence_parallel_trades_each_all_reduce_for_all_gather_and_reduce_scatter():
    counts = run_on_ranks(_collective_counts, 2)[0]
    n_layer = 2
    # Without SP (the negative control): Megatron's minimum, one all-reduce per sub-block each way, plus the
    # vocab-parallel embedding (forward), the head's entry (backward) and the head's output all-gather.
    assert counts[False, "forward"] == dict(all_gather=1, reduce_scatter=0, all_reduce=2 * n_layer + 1)
    assert counts[False, "backward"] == dict(all_gather=0, reduce_scatter=0, all_reduce=2 * n_layer + 1)
    # With SP: per sub-block an all-gather of its input and a reduce-scatter of its output, no all-reduce of
    # activations in the blocks; the head gathers the sequence, then the vocabulary. Backward mirrors it (plus the
    # first block's split), and all-reduces the gradient of each replicated parameter applied to sequence shards:
    # per block ln_1 and ln_2 (weight, bias) and the two row-parallel biases, plus ln_f.
    assert counts[True, "forward"] == dict(all_gather=2 * n_layer + 2, reduce_scatter=2 * n_layer, all_reduce=1)
    assert counts[True, "backward"] == dict(
        all_gather=2 * n_layer + 1, reduce_scatter=2 * n_layer + 1, all_reduce=6 * n_layer + 2
    )


# ------------------------------------------------------------------------------------- norm-weight gradients


def _norm_gradients(rank, world_size):
    import tp_train.plan.applying.sequence_parallel as sequence_parallel

    out = {}
    for reduce_norm_gradients in (True, False):
        if not reduce_norm_gradients:  # the negative control: the same SP model without the TP gradient all-reduce
            sequence_parallel._reduce_replicated_gradients = lambda *args: None
        torch.manual_seed(0)
        errors = parity_errors(
            _gpt(), _logits, VOCAB, steps=1, parallelize_kwargs=dict(sequence_parallel=True, verify=False)
        )
        out[reduce_norm_gradients] = {k: v for k, v in errors.items() if k == "logits" or k.startswith("grad:")}
    return out


@pytest.mark.slow
def test_norm_weight_gradients_are_summed_over_the_sequence_shards():
    for result in run_on_ranks(_norm_gradients, 2):
        assert max(result[True].values()) < ATOL, result[True]
        without = result[False]
        assert without["logits"] < ATOL  # the forward is right either way...
        for name in ("blocks.0.ln_1.weight", "blocks.1.ln_2.bias", "ln_f.weight", "blocks.0.mlp.proj.bias"):
            assert without[f"grad:{name}"] > 1e-4, (name, without)  # ...but each rank holds only its tokens' share
        assert without["grad:blocks.0.mlp.fc.weight"] < ATOL  # sharded weights never needed it


# ------------------------------------------------------------------------------------- dropout replay under AC


def _dropout_run(rank, world_size, sequence_parallel, activation_checkpointing, replay=True):
    """Losses over 2 steps, the first step's gathered gradients and first residual dropout mask of a GPT with
    dropout, from seed 0."""
    if not replay:  # the negative control: recompute with whatever the streams hold by then
        from contextlib import nullcontext

        tp_train.TensorParallelRNG.replay = lambda self, state: nullcontext()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32, dropout=0.2))
    tp_train.parallelize(model, sequence_parallel=sequence_parallel, activation_checkpointing=activation_checkpointing)
    masks = []
    model.blocks[0].dropout.register_forward_hook(lambda module, args, out: masks.append((out == 0).to(torch.uint8)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(7)
    losses, grads = [], None
    for step in range(2):
        idx = torch.randint(0, VOCAB, (2, 16), generator=data)
        loss = F.cross_entropy(model(idx)[:, :-1].flatten(0, 1), idx[:, 1:].flatten())
        loss.backward()
        losses.append(loss.item())
        if step == 0:
            grads = full_tensors(model, dist.group.WORLD, grads=True)
        opt.step()
        opt.zero_grad()
    return losses, grads, masks[0]


def _dropout_replay(rank, world_size):
    out = {}
    for sequence_parallel in (False, True):
        off = _dropout_run(rank, world_size, sequence_parallel, False)
        on = _dropout_run(rank, world_size, sequence_parallel, True)
        out[sequence_parallel] = _difference(off, on)
        masks = [torch.empty_like(off[2]) for _ in range(world_size)]
        dist.all_gather(masks, off[2])
        out["same_masks_on_every_rank", sequence_parallel] = all(torch.equal(masks[0], m) for m in masks)
    without_replay = _dropout_run(rank, world_size, False, True, replay=False)
    out["no_replay"] = _difference(_dropout_run(rank, world_size, False, False), without_replay)
    return out


def _difference(a, b):
    (losses_a, grads_a, _), (losses_b, grads_b, _) = a, b
    return max(
        max(abs(x - y) for x, y in zip(losses_a, losses_b, strict=True)),
        max((grads_a[name] - grads_b[name]).abs().max().item() for name in grads_a),
    )


@pytest.mark.slow
def test_recomputed_blocks_replay_the_same_dropout_masks():
    for result in run_on_ranks(_dropout_replay, 2, timeout=240):
        assert result[False] < 1e-6 and result[True] < 1e-6, result  # AC on == AC off, with and without SP
        assert result["no_replay"] > 1e-3, result  # without the replay, the recomputed masks differ
        # Dropout on the residual stream: one mask for the replicated stream, a mask per rank for its tokens.
        assert result["same_masks_on_every_rank", False] and not result["same_masks_on_every_rank", True]


# ------------------------------------------------------------------------------------------------- refusals


REFUSALS = {
    "block_without_forward": "'layers.0.attn' holds parallel layers but has no forward of its own",
    "no_head": "sequence_parallel needs one output head planned 'colwise_gather_output'",
    "reshaped_between_blocks_and_head": "GPT2LMHeadModel reshapes the hidden states",
    "odd_sequence": "sequence length 15 is not divisible by tensor_parallel_size=2",
    "no_blocks": "activation_checkpointing needs the transformer blocks in one nn.ModuleList",
}


def _refusals(rank, world_size):
    sp = dict(sequence_parallel=True)
    cases = {
        "block_without_forward": (SwiGLUModel, sp, 16),
        "no_head": (_gpt, dict(sp, plan={k: v for k, v in GPT.tp_plan.items() if k not in ("lm_head", "tok_emb")}), 16),
        "reshaped_between_blocks_and_head": (_hf_gpt2, sp, 16),
        "odd_sequence": (_gpt, sp, 15),
        "no_blocks": (_gpt, dict(activation_checkpointing=True, plan={"lm_head": "colwise_gather_output"}), 16),
    }
    messages = dict.fromkeys(cases)
    for case, (build, kwargs, length) in cases.items():
        torch.manual_seed(0)
        try:
            tp_train.parallelize(build(), **kwargs)(torch.randint(0, VOCAB, (2, length)))
        except ValueError as error:
            messages[case] = str(error)
    return messages


@pytest.mark.slow
def test_unsupported_models_are_refused_in_one_line():
    messages = run_on_ranks(_refusals, 2)[0]
    for case, expected in REFUSALS.items():
        message = messages[case]
        assert message is not None and expected in message and "\n" not in message, (case, message)


# --------------------------------------------------------------------------------------- Lightning strategy


def _fit_causal_lm(rank, world_size, tp, sequence_parallel, activation_checkpointing):
    import lightning as L
    from torch.utils.data import DataLoader

    from tests.lightning_helpers import StepRecorder

    torch.manual_seed(0)
    module = tp_train.CausalLMModule(
        model=functools.partial(GPT, GPTConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=4, n_embd=32)),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-2),
    )
    blocks = torch.randint(0, VOCAB, (5 * 4, 17), generator=torch.Generator().manual_seed(0))  # (B, T + 1)
    recorder = StepRecorder()
    strategy = tp_train.TensorParallelStrategy(
        tensor_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        activation_checkpointing=activation_checkpointing,
    )
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=5, callbacks=[recorder], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(module, DataLoader(blocks, batch_size=4 // (world_size // tp)))  # a global batch of 4
    checkpointed = type(module.model.blocks[0].forward).__name__ == "_CheckpointedForward"
    return recorder.losses, checkpointed


@pytest.mark.slow
def test_strategy_with_sequence_parallel_and_checkpointing_trains_like_one_device():
    reference, _ = run_on_ranks(_fit_causal_lm, 1, 1, False, False, timeout=240)[0]
    assert len(reference) == 5
    for losses, checkpointed in run_on_ranks(_fit_causal_lm, 2, 2, True, True, timeout=240):
        assert checkpointed
        assert losses == pytest.approx(reference, abs=1e-5)
        assert losses[-1] < losses[0]


def _verified_at_three(rank, world_size):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=48, n_layer=2, n_head=3, n_embd=48))
    tp_train.parallelize(model, sequence_parallel=True, verify=True)
    return True


@pytest.mark.slow
def test_verification_probes_a_length_sequence_parallelism_can_split_at_tp3():
    # The default probe is 8 tokens; at tp=3 verification must lengthen it, not blame the plan.
    assert run_on_ranks(_verified_at_three, 3, timeout=180) == [True] * 3
