"""The initial parameters a user's run trains from are one process's, bit for bit, at pp=2, pp=4, tp=2 and ep=2.

The user's path, as train.py takes it: `CausalLMModule` builds the model in `configure_model` under
`trainer.init_module(empty_init=True)` (the meta device, `tp_train.deferred_init`), and `TensorParallelStrategy.setup`
materialises and shards it (the tensor-parallel plan, the pipeline cut, the experts split). At `on_fit_start`, before
any step, every rank's parameters are taken whole: tensor-parallel shards gathered over their group, each pipeline
stage's under the model's own names, each rank's run of experts as the rows of the whole tensor it holds. Each must
equal (`torch.equal`) the parameter of the same model built the same way in one process (tp = pp = ep = 1).

Also where the ranks reach `configure_model` on different random streams (a `prepare_data`, run on rank 0 only, that
drew): the strategy has every rank materialise from rank 0's, which one process's stream is. Before it did, only a
tensor-parallel group's ranks were synced, and pp=2's second stage and ep=2's second rank's experts were drawn from
another stream than one process's (13 of 35 and 4 of 43 parameters)."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from models import GPT, GPTConfig, MoEConfig, MoEGPT
from tests.distributed import run_on_ranks
from tests.lightning_helpers import make_trainer
from tp_train import CausalLMModule
from tp_train.parallel.experts import named_expert_parameters
from tp_train.parallel.sharding import full_state_dict

SEED = 1234
VOCAB, SEQ = 64, 16
# Four blocks: one per stage at pp=4. The MoE's 8 experts split 4 and 4 at ep=2.
DENSE = partial(GPT, GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=32, dropout=0.0))
MOE = partial(MoEGPT, MoEConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=2, n_embd=16, bias=True,
                                n_expert=8, top_k=2, expert_hidden=24, shared_expert=True))  # fmt: skip


class DrawsOnRankZero(CausalLMModule):
    """A user's module whose `prepare_data`, which Lightning runs on (local) rank 0 only, draws from torch's default
    generator (a `random_split` written to disk, say): the ranks reach `configure_model` on different streams."""

    def prepare_data(self):
        torch.randperm(10)


# What one process builds, by name: (model, LightningModule).
BUILDS = {
    "dense": (DENSE, CausalLMModule),
    "moe": (MOE, CausalLMModule),
    "dense, rank 0 drew": (DENSE, DrawsOnRankZero),
    "moe, rank 0 drew": (MOE, DrawsOnRankZero),
}
# case -> (build, strategy arguments); each on 2 ranks but pp=4.
CASES = {
    "pp=2": ("dense", {"pipeline_parallel_size": 2}),
    "tp=2": ("dense", {"tensor_parallel_size": 2}),
    "ep=2": ("moe", {"expert_parallel_size": 2}),
    "pp=4": ("dense", {"pipeline_parallel_size": 4}),
    # Every rank materialises from rank 0's stream, as one process would draw: not only the tensor-parallel group's
    # ranks (each pipeline stage, each rank's experts).
    "pp=2, rank 0 drew": ("dense, rank 0 drew", {"pipeline_parallel_size": 2}),
    "ep=2, rank 0 drew": ("moe, rank 0 drew", {"expert_parallel_size": 2}),
    # Without verification a pipeline rank gives storage to its own stages only (cut before shard), each parameter
    # drawn under its own name's seed: the same weights whichever others the rank skips.
    "pp=2, cut before shard": ("dense", {"pipeline_parallel_size": 2, "verify_plan": False}),
    "pp=4, cut before shard": ("dense", {"pipeline_parallel_size": 4, "verify_plan": False}),
}


class InitialParameters(L.Callback):
    """At `on_fit_start` (the strategy's setup done, no step taken): name -> (first row, tensor) for every parameter
    of the LightningModule's model this rank holds, as one process would hold it (or, for experts, the rows of it
    this rank holds, from `first`)."""

    def __init__(self) -> None:
        self.parameters: dict[str, tuple[int, torch.Tensor]] = {}

    def on_fit_start(self, trainer, pl_module):
        model, strategy = pl_module.model, trainer.strategy
        experts = {name: region.first for name, _, region in named_expert_parameters(model)}
        whole = full_state_dict(model, strategy.tensor_parallel_group)  # a collective over the tensor-parallel group
        for name, param in model.named_parameters(remove_duplicate=False):  # a stage holds either side of a tie
            value = whole.get(name, param.detach())
            value = value.full_tensor() if isinstance(value, DTensor) else value
            self.parameters[name] = (experts.get(name, 0), value.detach().clone())


def _initial_parameters(rank, world_size, cases):
    """For each case: this rank's parameters (`InitialParameters`) once `fit` has set the model up, no step taken."""
    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, SEQ + 1)), batch_size=4)
    results = {}
    for case in cases:
        build, strategy = CASES[case] if case in CASES else (case, {})
        L.seed_everything(SEED)  # as train.py does
        model, lightning_module = BUILDS[build]
        module = lightning_module(model, partial(torch.optim.SGD, lr=0.1))
        grab = InitialParameters()
        settings = dict(strategy)
        tp = settings.pop("tensor_parallel_size", 1)
        trainer = make_trainer(tp, callbacks=[grab], strategy_kwargs=settings, max_steps=0)
        trainer.fit(module, data)
        assert dist.get_world_size() == world_size
        results[case] = grab.parameters
    return results


@pytest.mark.slow
def test_initial_parameters_at_pp_tp_and_ep_equal_one_process_bit_for_bit():
    (reference,) = run_on_ranks(_initial_parameters, 1, list(BUILDS))
    two = run_on_ranks(_initial_parameters, 2, [case for case in CASES if not case.startswith("pp=4")], timeout=240)
    four = run_on_ranks(_initial_parameters, 4, [case for case in CASES if case.startswith("pp=4")], timeout=240)
    for case, (build, _) in CASES.items():
        expected = reference[build]
        covered = {name: set() for name in expected}  # rows of each parameter some rank holds
        for rank, result in enumerate(four if case.startswith("pp=4") else two):
            held = result[case]
            assert held, (case, rank)
            for name, (first, value) in held.items():
                whole = expected[name][1]
                assert value.dtype == whole.dtype and value.shape[1:] == whole.shape[1:], (case, rank, name)
                rows = whole[first : first + len(value)]
                same = torch.equal(value, rows)
                assert same, (case, rank, name, (value - rows).abs().max().item())
                covered[name].update(range(first, first + len(value)))
        missing = [name for name, rows in covered.items() if rows != set(range(len(expected[name][1])))]
        assert not missing, (case, missing)  # every parameter of the model, whole, on some rank
    # Really initialised: drawn weights, not zeros or one constant; rank 0's draw moved the stream one process used.
    assert not torch.equal(
        reference["dense"]["tok_emb.weight"][1], reference["dense, rank 0 drew"]["tok_emb.weight"][1]
    )
    assert reference["dense"]["blocks.0.mlp.fc.weight"][1].std() > 0
    assert reference["moe"]["blocks.0.mlp.experts.w_in"][1].std() > 0
