"""Pipeline parallelism composed with the other dimensions, without Lightning: our GPT at pp=2 x tp=2 (with sequence
parallelism) and dp=2 with DDP (the 8-rank case), pp=2 x dp=2 with FSDP2 on each stage's module, and pp=2 x cp=2
over 10 optimizer steps equals one process (losses and final parameters to 1e-5). One start-up per world size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh

from tests.distributed import run_on_ranks
from tests.parity import full_tensors
from tests.test_pipeline import _errors, batches, tiny_gpt
from tp_train import parallelize
from tp_train.parallel.context_parallel.models import shard_targets
from tp_train.parallel.pipeline import Pipeline
from tp_train.parallel.pipeline.runner import refuse_sharded_ties
from tp_train.parallel.pipeline.ties import tied_parameters
from tp_train.parallel.sharding import local_part
from tp_train.training.data_parallel import fully_shard_data_parallel
from tp_train.training.pipeline_split import plan_pipeline_split

N_LAYER = 3
# name -> (tp, dp, cp, data parallelism over the stage, sequence parallel), on pp=2 x tp x dp x cp ranks. The 8-rank
# case holds pp x tp (with sequence parallelism) and pp x dp with DDP together, so neither runs alone on 4 ranks.
COMPOSITIONS = {
    "pp2_tp2_dp2_sp": (2, 2, 1, "ddp", True),
    "pp2_dp2_fsdp": (1, 2, 1, "fsdp", False),
    "pp2_cp2": (1, 1, 2, "ddp", False),
}


def ranks_of(name: str) -> int:
    tp, dp, cp, _, _ = COMPOSITIONS[name]
    return 2 * tp * dp * cp


class ShareOfBatchMean:
    """The last stage's loss for one microbatch: its tokens' summed cross-entropy over the whole (global) batch's
    count of targets, times the replicas (dp x cp) that DDP / FSDP2 average the gradients over, so that the
    averaged gradient is the whole batch's token mean's, whatever the padding. Under cp the logits are this rank's
    share of the sequence and the targets are cut to match."""

    def __init__(self, replicas: int, context) -> None:
        self.replicas, self.context, self.batch_tokens = replicas, context, 1

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.context is not None:
            target = shard_targets(target, self.context)
        total = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=-100, reduction="sum")
        return total * self.replicas / self.batch_tokens


def _train_composed(rank, world_size, name):
    tp, dp, cp, data_parallel, sequence_parallel = COMPOSITIONS[name]
    names = ("pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel")
    mesh = init_device_mesh("cpu", (2, dp, cp, tp), mesh_dim_names=names)
    replicas = mesh["data_parallel", "context_parallel"]._flatten("replicas")
    model = tiny_gpt(N_LAYER)
    split = plan_pipeline_split(model, 2)  # decided on the model as written, then sharded, then cut
    cp_group = mesh["context_parallel"].get_group() if cp > 1 else None
    # verify=False: the steps' parity below checks the sharded model, without the planner's own check's collectives
    parallelize(model, mesh["tensor_parallel"].get_group(), sequence_parallel=sequence_parallel, cp_group=cp_group,
                verify=False)  # fmt: skip
    if data_parallel == "fsdp":

        def wrap(stage):
            fully_shard_data_parallel(stage, [stage.module], replicas)
            return stage
    else:
        wrap = None
    loss_fn = ShareOfBatchMean(dp * cp, getattr(model, "tp_context_parallel", None))
    pipe = Pipeline(
        model,
        split,
        mesh["pipeline_parallel"].get_group(),
        "1f1b",
        2,
        torch.device("cpu"),
        loss_fn,
        True,
        wrap,
        replicas=replicas.get_group() if data_parallel == "ddp" else None,
    )
    optimizer = torch.optim.SGD(list(pipe.parameters()), lr=0.1, momentum=0.9)
    replica, per_replica = mesh["data_parallel"].get_local_rank(), batches()[0][0].shape[0] // dp
    losses = []
    for ids, targets in batches():
        loss_fn.batch_tokens = int((targets != -100).sum())
        rows = slice(replica * per_replica, (replica + 1) * per_replica)
        optimizer.zero_grad()
        loss = pipe.train_step(ids[rows], targets[rows]).reshape(1)
        dist.all_reduce(loss, group=replicas.get_group())  # the replicas' shares of the batch's mean
        losses.append(loss.item() / (dp * cp))
        optimizer.step()
    (stage,) = pipe.models
    if data_parallel == "fsdp":  # the whole of each parameter, gathered over the replicas
        params = {key: p.full_tensor() for key, p in stage.named_parameters(remove_duplicate=False)}
    else:
        params = full_tensors(stage, mesh["tensor_parallel"].get_group(), grads=False)
    return losses, {key: local_part(value).detach().clone() for key, value in params.items()}


def _compositions(rank, world_size, names):
    return {name: _train_composed(rank, world_size, name) for name in names}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [4, 8])
def test_pipeline_composed_with_tp_dp_cp_equals_one_process(world_size):
    names = [name for name in COMPOSITIONS if ranks_of(name) == world_size]
    results = run_on_ranks(_compositions, world_size, names, timeout=240)
    errors = {}
    for name in names:  # each rank's stage under the model's names, the whole model between them
        loss_error, param_error = _errors(N_LAYER, [rank[name] for rank in results])
        print(f"{name}: loss {loss_error:.2e} param {param_error:.2e}")
        errors[name] = max(loss_error, param_error)
    assert all(error < 1e-5 for error in errors.values()), errors


# Through Lightning: name -> (devices, strategy arguments beyond pp=2); one 4-rank start-up fits each in turn.
LIGHTNING_COMPOSITIONS = {
    "pp2_tp2_sp": dict(tensor_parallel_size=2, sequence_parallel=True),
    "pp2_dp2_ddp": dict(accumulate=2),  # averaged over dp once per optimizer step
    "pp2_dp2_fsdp": dict(data_parallel="fsdp", accumulate=2),
    "pp2_cp2": dict(context_parallel_size=2),
    # the loss scaled in the schedule, the inf check agreed by every rank: the same steps skipped as on one device
    "pp2_tp2_16mixed": dict(tensor_parallel_size=2, precision="16-mixed"),
    "pp2_tp2_bf16mixed": dict(tensor_parallel_size=2, precision="bf16-mixed"),  # autocast in each stage's chunks
    # bf16 weights; the default dtype is bf16 in a step, and the loss's buffers are float32 on every rank all the same
    "pp2_bf16true": dict(precision="bf16-true"),
    # 2 stages per rank (0 and 2, 1 and 3), each a view of the module's one model; the tie across ranks 0 and 1
    "pp2_dp2_interleaved": dict(pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=2, layers=4),
    "pp2_dp2_looped_bfs": dict(pipeline_schedule="looped_bfs", pipeline_virtual_stages=2, layers=4),
    # the zero-bubble schedules (backward for inputs and for weights apart); a V places stages 0 and 3 on rank 0, so
    # its tied embedding and head are one parameter there, counted once in the clipping norm
    "pp2_dp2_interleaved_zero_bubble": dict(
        pipeline_schedule="interleaved_zero_bubble", pipeline_virtual_stages=2, layers=4
    ),
    "pp2_dp2_zbv": dict(pipeline_schedule="zbv_zero_bubble", pipeline_virtual_stages=2, layers=4),
    "pp2_tp2_dualpipev": dict(
        tensor_parallel_size=2,
        pipeline_schedule="dualpipev",
        pipeline_virtual_stages=2,
        pipeline_microbatches=4,
        layers=4,
    ),  # as many microbatches as stages
    # FSDP2 on each of a rank's stage views, which share the model: its hooks ran for the other view's stage too
    "pp2_dp2_interleaved_fsdp": dict(
        pipeline_schedule="interleaved_1f1b", pipeline_virtual_stages=2, layers=4, data_parallel="fsdp"
    ),
    # a block per rank, the embedding on the first and its tied head on the last: the tie across ranks 0 and 3
    "pp4_tied": dict(pipeline_parallel_size=4, pipeline_microbatches=4, layers=4),
}
# plain Lightning on one device, at each precision and accumulation the compositions use
PLAIN = {"plain": dict(), "plain_16mixed": dict(precision="16-mixed"), "plain_bf16mixed": dict(precision="bf16-mixed"),
         "plain_accumulate2": dict(accumulate=2), "plain_4blocks": dict(layers=4),
         "plain_bf16true": dict(precision="bf16-true")}  # fmt: skip


def _reference_of(name: str) -> str:
    settings = LIGHTNING_COMPOSITIONS[name]
    wanted = {key: settings[key] for key in ("precision", "accumulate", "layers") if key in settings}
    return next(plain for plain, those in PLAIN.items() if those == wanted)


LIGHTNING_STEPS, CLIP = 6, 0.5


def _lightning_data():
    """Unpadded targets: each data-parallel replica's mean then weighs as much as the other's, so their average
    (DDP's) is the batch's mean on one device (padding uneven across microbatches: test_pipeline_lightning)."""
    ids, targets = (torch.cat(parts) for parts in zip(*batches(LIGHTNING_STEPS), strict=True))
    return ids, targets.clamp(min=0)


def _fit_composed(rank, world_size, names):
    import lightning.pytorch as L
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    from torch.distributed.tensor import DTensor
    from torch.utils.data import DataLoader, TensorDataset

    from tests.test_pipeline_lightning import LoggedLoss, PlainLM
    from tp_train import TensorParallelStrategy

    torch.set_num_threads(1)
    ids, targets = _lightning_data()
    out = {}
    for name in names:
        plain = name in PLAIN
        kwargs = {} if plain else dict(pipeline_parallel_size=2, pipeline_microbatches=2)
        kwargs.update(PLAIN[name] if plain else LIGHTNING_COMPOSITIONS[name])
        precision, accumulate = kwargs.pop("precision", "32-true"), kwargs.pop("accumulate", 1)
        layers = kwargs.pop("layers", N_LAYER)
        plugins = None
        if precision == "16-mixed":  # Lightning turns 16-mixed into bf16-mixed on CPU unless given the plugin
            scaler = torch.amp.GradScaler("cpu") if plain else ShardedGradScaler("cpu")
            plugins, precision = [MixedPrecision("16-mixed", "cpu", scaler)], None
        inner = kwargs.get("tensor_parallel_size", 1) * kwargs.get("context_parallel_size", 1)  # mesh (pp, dp, cp, tp)
        replicas = 1 if plain else world_size // (kwargs["pipeline_parallel_size"] * inner)
        replica = rank // inner % replicas
        module, recorder = PlainLM(layers), LoggedLoss()
        trainer = L.Trainer(
            strategy="auto" if plain else TensorParallelStrategy(**kwargs),
            accelerator="cpu",
            devices=1 if plain else world_size,
            precision=precision,
            plugins=plugins,
            max_steps=LIGHTNING_STEPS // accumulate,
            accumulate_grad_batches=accumulate,
            callbacks=[recorder],
            gradient_clip_val=CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            use_distributed_sampler=False,
        )
        # The batch of 4 on one device; its rows dealt over the data-parallel replicas, 4 / dp each
        share = 4 // replicas
        rows = [step * 4 + replica * share + k for step in range(LIGHTNING_STEPS) for k in range(share)]
        trainer.fit(module, DataLoader(TensorDataset(ids[rows], targets[rows]), batch_size=share))
        params = {}
        for key, param in module.model.named_parameters(remove_duplicate=False):
            params[key] = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if not plain and kwargs.get("data_parallel") != "fsdp":  # tensor-parallel shards gathered
            gathered = full_tensors(module.model, trainer.strategy.tensor_parallel_group, grads=False)
            first_name = {id(param): name for name, param in module.model.named_parameters()}
            # a parameter under two names on one rank (a V's rank 0 holds the embedding and its tied head) once
            params = {key: gathered[first_name[id(param)]]
                      for key, param in module.model.named_parameters(remove_duplicate=False)}  # fmt: skip
            params = {key: local_part(value).detach().clone() for key, value in params.items()}
        norm = None if plain else trainer.strategy.precision_plugin.last_grad_norm.item()
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        out[name] = (recorder.logged, params, norm, None if scaler is None else scaler.get_scale())
    return out


def _batch_losses(results: list[dict], name: str) -> list[float]:
    """What every rank logged: the whole batch's loss, over the data-parallel replicas too (the same on each)."""
    logged = [rank[name][0] for rank in results]
    assert all(other == pytest.approx(logged[0], abs=1e-6) for other in logged), (name, logged)
    return logged[0]


@pytest.mark.slow
def test_pipeline_composed_through_lightning_equals_plain_lightning():
    references = run_on_ranks(_fit_composed, 1, list(PLAIN))[0]
    results = run_on_ranks(_fit_composed, 4, list(LIGHTNING_COMPOSITIONS), timeout=300)
    errors = {}
    for name in LIGHTNING_COMPOSITIONS:
        reference = references[_reference_of(name)]
        reference_logged, reference_params, _, reference_scale = reference
        logged = _batch_losses(results, name)
        loss_error = max(abs(a - b) for a, b in zip(logged, reference_logged, strict=True))
        merged = {}
        for rank in results:
            merged.update(rank[name][1])
        assert set(merged) == set(reference_params), name
        param_error = max((merged[key] - reference_params[key]).abs().max().item() for key in merged)
        norms = {rank[name][2] for rank in results}
        scales = {rank[name][3] for rank in results}
        print(f"lightning {name}: loss {loss_error:.2e} param {param_error:.2e} clip norm {sorted(norms)} {scales}")
        assert scales == {reference_scale}, name  # every rank's scaler, and plain Lightning's, skipped no step
        assert max(norms) - min(norms) < 1e-6 and min(norms) > CLIP, name  # one norm, over every rank's shards
        errors[name] = max(loss_error, param_error)
    # fp32 to 1e-5; the autocasts to their rounding against plain Lightning at the same precision, measured 5.1e-5
    # (16-mixed) and 4.9e-4 (bf16-mixed), as test_precision's tp=2 against fp32 (7.7e-5, 5.4e-4)
    # bf16-true: one bf16 step of the loss near 5 (2^-5, measured 1.7e-2) and of a weight (measured 9.8e-4, 2^-10)
    bounds = {"pp2_tp2_16mixed": 2e-4, "pp2_tp2_bf16mixed": 5e-3, "pp2_bf16true": 2**-5}
    # bf16's autocast ran in the stages: its losses are not fp32's (which equal plain fp32's to 1e-5)
    bf16_logged = _batch_losses(results, "pp2_tp2_bf16mixed")
    autocast_gap = max(abs(a - b) for a, b in zip(bf16_logged, references["plain"][0], strict=True))
    print(f"pp2_tp2_bf16mixed against plain fp32: loss {autocast_gap:.2e}")
    assert autocast_gap > 1e-4, autocast_gap
    assert all(error < bounds.get(name, 1e-5) for name, error in errors.items()), errors


def test_fsdp_with_tied_parameters_over_three_stages_is_refused_in_one_line():
    ties = tied_parameters(tiny_gpt(N_LAYER))
    refuse_sharded_ties(ties, 2)  # two stages: each holds a copy
    with pytest.raises(ValueError) as error:
        refuse_sharded_ties(ties, 3)
    assert str(error.value) == (
        "pipeline_parallel_size=3 with data_parallel='fsdp' and tied parameters ('tok_emb.weight') is not supported "
        "yet (only 2 stages are); use pipeline_parallel_size=2 or data_parallel='ddp'"
    )
