"""The parity pattern, shared by the whole-model tests: build the unsharded reference with a fixed seed, shard a
deep copy, and measure how far the sharded model's logits, gradients, losses and weights are from the reference.
Runs inside a rank (see `tests.distributed.run_on_ranks`): rank 0 alone trains the reference and sends its numbers;
every rank measures its own sharded model against them."""

from __future__ import annotations

import contextlib
import copy
import io
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_train
import tp_train.plan.parallelize as parallelize_module
from tp_train.parallel.mesh import first_rank_decides
from tp_train.parallel.sharding import ceil_div, full_numel, replicated_rows

VOCAB_OF_TESTS = 101  # not a multiple of 2 or 4: exercises vocabulary padding


def next_token_loss(logits: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), idx[:, 1:].flatten())


def parity_errors(
    reference,
    forward,
    vocab_size: int,
    steps: int = 3,
    seq_len: int = 16,
    parallelize_kwargs: dict | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, float]:
    """Max-abs errors of a sharded copy of `reference` against it, over `steps` SGD-with-momentum steps.

    Not Adam: some parameters have an exactly-zero true gradient (a key bias: softmax ignores a shift common to
    all keys), so both models hold only ~1e-9 round-off there, which Adam would normalise into lr-sized updates.

    `forward(model, idx)` returns logits. Keys: `logits`, `grad:<param>` (first step, every parameter, sharded ones
    gathered), `loss_step<k>`, `param:<param>` (after the last step); plus `shard_fraction`, the rank's share of the
    sharded parameters' elements (about 1/tp), and `block_fraction`, its share of the block matrices.
    `parallelize_kwargs` go to `tp_train.parallelize`. On `device` ("cuda": every rank's current GPU) both models
    run there, on the same batches as on CPU.

    Of `parallelize`'s own verification, the checks of each swapped module and region run as they do by default (so
    that every case also shows that verification accepts its correct plan); the whole-model check does not, unless
    `verify=True` asks for it: it compares one batch's logits and gradients with the unsharded model's within 1e-4
    relative, which these numbers measure within 1e-5 over every step, so here it would only repeat them (22% of
    py-spy's samples of test_planner_families' tp=4 batch; three parity files took 208 CPU-seconds instead of 233,
    2026-12-07).
    """
    generator = torch.Generator().manual_seed(1234)
    batches = [torch.randint(0, vocab_size, (2, seq_len), generator=generator).to(device) for _ in range(steps)]
    reference = reference.to(device)
    return batch_parity_errors(
        reference, [(idx, forward, lambda logits, idx=idx: next_token_loss(logits, idx)) for idx in batches],
        parallelize_kwargs,
    )  # fmt: skip


def batch_parity_errors(reference, steps: list[tuple], parallelize_kwargs: dict | None = None) -> dict[str, float]:
    """`parity_errors` over any inputs: one SGD step per `(batch, forward, loss)` in `steps`, where
    `forward(model, batch)` returns the output compared (as `logits`) and `loss(output)` the scalar trained on.

    The reference is the same model on every rank (built from one seed), so rank 0 alone trains it and sends its
    numbers to the others (`_reference_step`); every rank compares its own sharded numbers with them."""
    group = dist.group.WORLD
    with mock.patch.object(parallelize_module, "WHOLE_MODEL_CHECK_BYTES", 0):  # see parity_errors
        model = tp_train.parallelize(copy.deepcopy(reference), **(parallelize_kwargs or {}))
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    errors: dict[str, float] = {}
    for step, (batch, forward, loss_of) in enumerate(steps):
        ref = _reference_step(reference, ref_opt, batch, forward, loss_of, step == 0, group)
        logits = forward(model, batch)
        loss = loss_of(logits)
        loss.backward()
        errors[f"loss_step{step}"] = (ref["loss"] - loss.detach().cpu()).abs().item()
        if step == 0:
            errors["logits"] = (ref["logits"] - logits.detach().cpu()).abs().max().item()
            for name, grad in full_tensors(model, group, grads=True).items():
                if grad is None and ref["grads"][name] is None:
                    continue  # a parameter the forward never uses (an encoder's, in a decoder-only forward)
                errors[f"grad:{name}"] = (ref["grads"][name] - grad.cpu()).abs().max().item()
        opt.step()
        opt.zero_grad()
    ref_params = _trained_reference(reference, group)
    for name, param in full_tensors(model, group, grads=False).items():
        errors[f"param:{name}"] = (ref_params[name] - param.cpu()).abs().max().item()
    errors["shard_fraction"] = _shard_fraction(model, dist.get_world_size(group))
    errors["block_fraction"] = _block_fraction(model)
    errors["replica_spread"] = _replica_spread(model, group)
    return errors


def _reference_step(reference, ref_opt, batch, forward, loss_of, first: bool, group) -> dict:
    """One training step of the unsharded reference on rank 0, its numbers (on the CPU) sent to every rank: the loss;
    at the first step the output and every parameter's gradient (None where the forward never used it). Rank 0's
    random streams are left as they were before it, as the other ranks' are."""

    def step() -> dict:
        devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
        with torch.random.fork_rng(devices=devices):
            output = forward(reference, batch)
            loss = loss_of(output)
            loss.backward()
        numbers = {"loss": loss.detach().cpu()}
        if first:
            numbers["logits"] = output.detach().cpu()
            numbers["grads"] = {
                name: None if param.grad is None else param.grad.cpu() for name, param in reference.named_parameters()
            }
        ref_opt.step()
        ref_opt.zero_grad()
        return numbers

    return first_rank_decides(step, group)


def _trained_reference(reference, group) -> dict[str, torch.Tensor]:
    """Rank 0's reference parameters after its steps (on the CPU), also copied, with its buffers, into every other
    rank's reference: a caller goes on with the trained reference on every rank, as if each had trained it."""
    state = first_rank_decides(lambda: {name: tensor.detach().cpu() for name, tensor in _named_state(reference)}, group)
    if dist.get_rank(group) != 0:
        with torch.no_grad():
            for name, tensor in _named_state(reference):
                tensor.copy_(state[name])
    return state


def _named_state(module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _replica_spread(model, group) -> float:
    """The largest difference between the ranks holding a replicated section (kv heads, Mamba2's B and C groups fewer
    than ranks) after the steps: exactly 0 when their gradients were summed over the replicas (a missing sum leaves
    each replica stepping with its own partial gradient, however small)."""
    world_size, spread = dist.get_world_size(group), 0.0
    for _, param, spec in tp_train.named_sharded_parameters(model):
        for start, rows, copies in replicated_rows(spec, world_size):
            piece = param.detach().narrow(spec.dim, start, rows).contiguous()
            everyone = [torch.empty_like(piece) for _ in range(world_size)]
            dist.all_gather(everyone, piece, group=group)
            for rank, other in enumerate(everyone):
                spread = max(spread, (other - everyone[rank - rank % copies]).abs().max().item())
    return spread


def parity_of_each(models: dict) -> dict[str, dict[str, float]]:
    """`parity_errors` of each model in {name: (build, forward)}, each built after seeding 0 (inside a rank; one
    spawn for many models, since spawning ranks dominates the cost). What the models print is not shown."""
    results = {}
    with contextlib.redirect_stdout(io.StringIO()):
        for name, (build, forward) in models.items():
            torch.manual_seed(0)
            results[name] = parity_errors(build(), forward, vocab_size=VOCAB_OF_TESTS)
    return results


def full_tensors(model, group, grads: bool) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) of the sharded model, gathered to full size where sharded."""
    specs = {name: spec for name, _, spec in tp_train.named_sharded_parameters(model)}
    out = {name: param.grad if grads else param.detach() for name, param in model.named_parameters()}
    sharded = [name for name, tensor in out.items() if name in specs and tensor is not None]
    gathered = tp_train.unshard_tensors([(out[name], specs[name]) for name in sharded], group)
    return {**out, **dict(zip(sharded, gathered, strict=True))}


def _shard_fraction(model, tp: int) -> float:
    """Elements this rank holds of the sharded parameters, over their full (unpadded) element count."""
    local = full = 0
    for _, param, spec in tp_train.named_sharded_parameters(model):
        local += param.numel()
        full += full_numel(param, spec)
        if spec.padded:  # a padded vocab: each rank holds ceil(V / tp) rows
            assert param.shape[spec.dim] == ceil_div(spec.sections[0], tp)
    return local / full


def _block_fraction(model) -> float:
    """Elements this rank holds of the matrices inside the transformer blocks (parameters of two or more dims
    under a numbered layer), over their full count: 1/tp when every block matrix is sharded."""
    specs = {id(param): spec for _, param, spec in tp_train.named_sharded_parameters(model)}
    local = full = 0
    for name, param in model.named_parameters():
        if param.dim() >= 2 and any(part.isdigit() for part in name.split(".")):
            local += param.numel()
            full += full_numel(param, specs[id(param)]) if id(param) in specs else param.numel()
    return local / full


def assert_parity(errors: dict[str, float], tp: int, rank: int, atol: float = 1e-5, block_rel_tol: float = 0.0) -> None:
    """`parity_errors` of one rank are all within `atol`, cover logits, losses, gradients and parameters, and the
    rank held 1/tp of every sharded parameter (a padded vocabulary rounds up slightly) and exactly 1/tp of the
    transformer blocks' matrices (up to `block_rel_tol` more, for matrices a model keeps whole on purpose, an MoE
    router, or replicates, kv heads fewer than ranks)."""
    errors = dict(errors)
    shard_fraction = errors.pop("shard_fraction")
    block_fraction = errors.pop("block_fraction")
    spread = errors.pop("replica_spread", 0.0)
    assert spread == 0.0, f"rank {rank}: replicas of a replicated section differ by {spread:.3g} after the steps"
    assert {"logits", "loss_step0", "loss_step2"} <= errors.keys()
    assert any(key.startswith("grad:") for key in errors) and any(key.startswith("param:") for key in errors)
    worst = max(errors, key=errors.get)
    assert errors[worst] < atol, f"rank {rank}: {worst} differs by {errors[worst]:.3g}"
    assert 0.95 / tp <= shard_fraction <= (1 + max(0.05, block_rel_tol)) / tp, shard_fraction
    assert 1 / tp - 1e-9 <= block_fraction <= (1 + block_rel_tol) / tp + 1e-9, (
        f"rank {rank} holds {block_fraction:.4f} of the block matrices"
    )
