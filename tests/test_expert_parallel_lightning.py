"""Expert parallelism through Lightning: our MoE GPT (models/moe.py: 8 experts, top-2, dropless) under
TensorParallelStrategy(expert_parallel_size=2) on four data-parallel ranks (two expert-parallel groups, so each
expert is held by two ranks) trains as plain Lightning does on one device (10 steps with norm clipping, SGD and
AdamW: losses, clipping norms and final parameters to 1e-5), the experts split between the ranks and their
gradients averaged over exactly the ranks that hold them; at ep=2 x tp=2 (SGD and AdamW) too. Its checkpoint, which
stores the experts by their global index, resumes at ep=1, 2 and 4 with the next losses of plain Lightning resuming
its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Callback
from torch.distributed.tensor import DTensor

from models.moe import MoEConfig, MoEGPT
from tests.distributed import run_on_ranks
from tests.lightning_helpers import LitLM, StepRecorder, loader, make_trainer
from tests.test_parallelize import VOCAB
from tp_train.parallel.experts import named_expert_parameters
from tp_train.parallel.sharding import full_state_dict

STEPS, NEXT, CLIP = 10, 2, 0.05  # small enough that every step is clipped: the norm must count each expert once
OPTIMIZERS = ("sgd", "adamw")
# AdamW at lr=1e-3 with eps=1e-6, well conditioned: at lr=1e-2 and eps=1e-8 (weights of std 0.02 moved by half
# their size per step) ep=2 x tp=2 and tp=2 alone end 7.1e-5 from one device. Not a bug: the tensor-parallel
# gradients agree with one device's to 4e-7 of each tensor's largest (our dense GPT's: 3.4e-7), but an expert
# weight whose gradient cancels to 5.5e-9 (near eps; 1 of 3,072) gets a first Adam step lr * g / (|g| + eps) that
# moves by 1.4e-4 on that rounding, exactly Adam's formula applied to the two gradients (docs/experts.md). Here
# ep=2 x tp=2 ends 1.0e-7 from one device (1.2e-7 with sequence parallelism).
ADAM_LR, ADAM_EPS = 1e-3, 1e-6


def _moe() -> MoEGPT:
    return MoEGPT(MoEConfig(vocab_size=VOCAB, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=False,
                            n_expert=8, top_k=2, expert_hidden=24, shared_expert=True))  # fmt: skip


class MoELM(LitLM):
    def __init__(self, optimizer: str):
        super().__init__(lr=1e-2, build=_moe)
        self.optimizer = optimizer

    def configure_optimizers(self):
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=ADAM_LR, weight_decay=0.1, eps=ADAM_EPS)


def _whole_parameters(module: torch.nn.Module, tensor_parallel_group=None) -> dict[str, torch.Tensor]:
    """Every parameter as one process holds it: tensor-parallel shards gathered over `tensor_parallel_group`, each
    expert-parallel slice over its group."""
    experts = {name: region for name, _, region in named_expert_parameters(module)}
    state = full_state_dict(module, tensor_parallel_group) if tensor_parallel_group is not None else {}
    whole = {}
    for name, param in module.named_parameters(remove_duplicate=False):  # a pipeline stage holds either tie
        value = state.get(name, param.detach())
        value = value.full_tensor() if isinstance(value, DTensor) else value  # FSDP2's shard of a dense parameter
        if name in experts:
            group = experts[name].group
            pieces = [torch.empty_like(value) for _ in range(dist.get_world_size(group))]
            dist.all_gather(pieces, value.contiguous(), group=group)
            value = torch.cat(pieces)
        whole[name] = value.clone()
    return whole


def _trainer(
    expert_parallel_size: int | None, recorder: StepRecorder, steps: int, tensor_parallel_size: int = 1, **strategy
):
    plain, data_parallel = expert_parallel_size is None, strategy.pop("data_parallel", "ddp")
    # At tp > 1 with sequence parallelism: each tensor-parallel rank routes its own sequence shard's tokens
    strategy = {"expert_parallel_size": expert_parallel_size, "sequence_parallel": tensor_parallel_size > 1, **strategy}
    return make_trainer(
        None if plain else tensor_parallel_size, [recorder], data_parallel, max_steps=steps, gradient_clip_val=CLIP,
        strategy_kwargs=None if plain else strategy,
    )  # fmt: skip


# More cases on the same 4 ranks, each against plain Lightning with its optimizer: (optimizer, ep, strategy kwargs).
CASES = {
    # FSDP2 shards the dense parameters over the 4 replicas; each rank's experts stay whole, replicated over its 2
    # expert replicas and averaged over them.
    "sgd, fsdp": ("sgd", 2, {"data_parallel": "fsdp"}),
    "adamw, fsdp": ("adamw", 2, {"data_parallel": "fsdp"}),
    # ep=4: every rank its own 2 experts per layer, held by no other rank.
    "adamw, ep=4": ("adamw", 4, {}),
    # a capacity no expert reaches (E / k: each of a rank's tokens routed to one expert at most once): dropless.
    "sgd, ep=4, capacity": ("sgd", 4, {"expert_capacity_factor": 4.0}),
    # 2 pipeline stages of one MoE layer each, over 2 replicas: each stage's experts split between its 2 ranks.
    "adamw, pp=2": ("adamw", 2, {"pipeline_parallel_size": 2}),
    "sgd, pp=2, fsdp": ("sgd", 2, {"pipeline_parallel_size": 2, "data_parallel": "fsdp"}),
}


class RouteRecorder(Callback):
    """The experts each MoE layer's router chose for this rank's tokens in the last training step, as the model
    handed them to its experts module (before expert parallelism's dispatch)."""

    def __init__(self):
        self.routes: list[torch.Tensor] = []
        self._hooked = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.routes.clear()
        if not self._hooked:
            for block in pl_module.model.blocks:
                hook = lambda module, args: self.routes.append(args[1].clone())  # noqa: E731
                block.mlp.experts.register_forward_pre_hook(hook, prepend=True)
            self._hooked = True


def _dropped_over_capacity() -> tuple[list[float], list[int]]:
    """One step at ep=2 with expert_capacity_factor=1: each expert takes ceil(1 x 16 tokens x 2 / 8) = 4 of a
    rank's assignments. Each layer's logged count of dropped assignments, and the count by hand from the routes
    every rank's routers chose (over 4 per expert, summed over the ranks)."""
    torch.manual_seed(0)
    module, routes = MoELM("sgd"), RouteRecorder()
    trainer = make_trainer(1, [routes], max_steps=1, strategy_kwargs={"expert_parallel_size": 2,
                                                                       "expert_capacity_factor": 1.0})  # fmt: skip
    trainer.fit(module, loader(1, 1))
    by_hand = torch.stack([(torch.bincount(r.reshape(-1), minlength=8) - 4).clamp(min=0).sum() for r in routes.routes])
    dist.all_reduce(by_hand)
    logged = [trainer.callback_metrics[f"train/moe/dropped_{layer}"].item() for layer in range(len(by_hand))]
    return logged, by_hand.tolist()


def _resume(expert_parallel_size: int | None, checkpoint: str) -> list[float]:
    """The losses of the NEXT steps after `checkpoint` (AdamW, its moments included), at `expert_parallel_size`
    (None: plain Lightning on one device)."""
    torch.manual_seed(1)  # another init: everything must come from the checkpoint
    recorder = StepRecorder()
    trainer = _trainer(expert_parallel_size, recorder, STEPS + NEXT)
    trainer.fit(MoELM("adamw"), loader(None if expert_parallel_size is None else 1, STEPS), ckpt_path=checkpoint)
    return recorder.losses


def _fit(rank, world_size, expert_parallel_size, checkpoint):
    """Per optimizer: (losses, clipping norms, final parameters, experts held); plain Lightning on one device at
    expert_parallel_size=None. Then, from the AdamW run's `checkpoint` (saved at ep=2 on 4 ranks): the next
    steps' losses at each expert-parallel size this world allows."""
    results = {}
    for optimizer in OPTIMIZERS:
        torch.manual_seed(0)
        module, recorder = MoELM(optimizer), StepRecorder()
        plain = expert_parallel_size is None
        trainer = _trainer(expert_parallel_size, recorder, STEPS)
        trainer.fit(module, loader(None if plain else 1, STEPS))
        norms = recorder.local_norms if plain else recorder.clip_norms  # before clipping, on one device: the norm
        held = {name: param.shape[0] for name, param, _ in named_expert_parameters(module)}  # experts on this rank
        results[optimizer] = (recorder.losses, norms, _whole_parameters(module), held)
        if optimizer == "adamw":
            trainer.save_checkpoint(checkpoint if not plain else checkpoint + ".plain")
    if world_size > 1:
        # ep=2 x tp=2 with sequence parallelism: attention and the shared expert tensor-parallel, the experts whole,
        # each tensor-parallel rank dispatching its own sequence shard's tokens (AdamW: see ADAM_EPS).
        for optimizer in OPTIMIZERS:
            torch.manual_seed(0)
            module, recorder = MoELM(optimizer), StepRecorder()
            trainer = _trainer(2, recorder, STEPS, tensor_parallel_size=2)
            trainer.fit(module, loader(2, STEPS))
            whole = _whole_parameters(module, trainer.strategy.tensor_parallel_group)
            results[f"{optimizer}, tp=2"] = (recorder.losses, recorder.clip_norms, whole, {})
        for case, (optimizer, size, strategy) in CASES.items():
            torch.manual_seed(0)
            module, recorder = MoELM(optimizer), StepRecorder()
            trainer = _trainer(size, recorder, STEPS, **strategy)
            trainer.fit(module, loader(strategy.get("pipeline_parallel_size", 1), STEPS))  # 4 replicas over pp
            held = {name: param.shape[0] for name, param, _ in named_expert_parameters(module)}
            results[case] = (recorder.losses, recorder.clip_norms, _whole_parameters(module), held)
        results["dropped"] = _dropped_over_capacity()
        return results, {size: _resume(size, checkpoint) for size in (2, 4)}
    # Plain Lightning resuming its own checkpoint is what a resume must give (a resume is not the run without a
    # stop in Lightning itself: the step after the first differs by 1e-2 on one device).
    return results, {1: _resume(1, checkpoint), None: _resume(None, checkpoint + ".plain")}


@pytest.mark.slow
def test_our_moe_at_ep_2_through_lightning_trains_like_one_device_and_resumes_at_ep_1_and_4(tmp_path):
    checkpoint = str(tmp_path / "ep2.ckpt")
    results = run_on_ranks(_fit, 4, 2, checkpoint, timeout=300)
    (reference, at_one), *_ = run_on_ranks(_fit, 1, None, checkpoint, timeout=300)
    for rank, (result, resumed) in enumerate(results):
        assert len(at_one[None]) == NEXT
        for size in (1, 2, 4):  # every expert and its AdamW moments stored by expert index: any ep resumes alike
            next_losses = at_one[1] if size == 1 else resumed[size]
            assert next_losses == pytest.approx(at_one[None], abs=1e-5), (rank, size, next_losses, at_one[None])
        logged, by_hand = result.pop("dropped")
        assert logged == by_hand and len(by_hand) == 2 and min(by_hand) > 0, (rank, logged, by_hand)
        for optimizer in (*OPTIMIZERS, "sgd, tp=2", "adamw, tp=2", *CASES):
            losses, norms, params, held = result[optimizer]
            expected_losses, expected_norms, expected_params, _ = reference[optimizer.split(",")[0]]
            if held:  # w_in, w_out of 2 layers (1 per pipeline stage): 4 of 8 experts at ep=2, 2 at ep=4
                _, ep, strategy = CASES.get(optimizer, (None, 2, {}))
                layers = 2 // strategy.get("pipeline_parallel_size", 1)
                assert len(held) == 2 * layers and set(held.values()) == {8 // ep}, held
            assert losses == pytest.approx(expected_losses, abs=1e-5), (rank, optimizer)
            assert norms == pytest.approx(expected_norms, rel=1e-5), (rank, optimizer)
            assert min(expected_norms) > CLIP
            for name, value in params.items():
                error = (value - expected_params[name]).abs().max().item()
                assert error < 1e-5, (rank, optimizer, name, error)
