"""Checking one family on one rank: shard it with no plan given, compare with the unsharded model (outputs, every
gradient, three SGD steps of losses), and classify the result."""

from __future__ import annotations

import contextlib
import copy
import io

from tp_train.tools.zoo.configs import TOLERANCE, build_family

CLASSES = ("pass", "round-off", "refused", "WRONG", "killed", "error", "unsharded", "unbuildable", "no blocks")
NOT_COUNTED = ("unbuildable", "no blocks")  # classes of families that are not among a task's buildable transformers
# A pass holds at most this fraction of the trained block matrices whole on every rank (routers, convs, MLA latents),
# whatever the tp; split as far as its units allow counts as split (kv heads fewer than the ranks, a Mamba2 group's B
# and C). Why not 1.15/tp: docs/zoo.md.
WHOLE = 0.15
# With an attention the planner says it keeps whole, a pass still shards at least 1/tp + this of the trained block
# matrices (issue 24's bar); at the tiny sizes (an MLP twice the width) an MLP alone does not reach it.
KEPT_WHOLE_MARGIN = 0.15


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
    from tp_train.plan.compare import first_tensor  # the logits, else a tower's hidden states
    from tp_train.tools.zoo_tasks import batches

    torch.manual_seed(0)
    try:
        reference = build_family(task, model_type, fields).eval()
        if not has_block_linears(reference):
            return {
                "class": "no blocks",
                "reason": "its repeated blocks hold no Linear layer (a convolutional network)",
            }
        steps = batches(task, reference, steps)
        with torch.no_grad():
            if not torch.isfinite(first_tensor(steps[0][0](reference))).all():
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
            logits = [first_tensor(inputs(m)) for m in (reference, model)]
            losses = [loss_of(out) for out in logits]
            for loss in losses:
                loss.backward()
            differences = {f"loss at step {step}": (losses[0] - losses[1]).abs().item()}
            if step == 0:
                differences["logits"] = (logits[0] - logits[1]).abs().max().item()
                reference_params = dict(reference.named_parameters())
                whole, first_whole = _block_share(model, reference)
                grads = {name: param.grad for name, param in model.named_parameters()}
                sharded = [name for name, grad in grads.items() if grad is not None and name in specs]
                gathered = tp_train.unshard_tensors([(grads[name], specs[name]) for name in sharded], dist.group.WORLD)
                grads.update(zip(sharded, gathered, strict=True))
                for name, grad in grads.items():
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
    holds_too_much = too_much_held(whole, tp, kept_whole)
    if holds_too_much:
        reason = f"matches (largest difference {worst:.1e}), but {holds_too_much}"
        reason += f" ('{first_whole}' among them)" if first_whole else ""
        return {"class": "unsharded", "reason": reason, "kept_whole": kept_whole}
    reason = f"largest difference {worst:.1e}; {whole:.2f} of the block matrices whole on every rank"
    return {"class": "pass", "reason": reason, "kept_whole": kept_whole}


def too_much_held(whole: float, tp: int, kept_whole: bool) -> str:
    """Why a family whose ranks hold `whole` of the trained block matrices whole at `tp` is `unsharded` ('' when it
    is not): more than `WHOLE` of them, or, with an attention the planner keeps whole, less than 1/tp +
    `KEPT_WHOLE_MARGIN` of them split."""
    if not kept_whole and whole > WHOLE:
        return f"{whole:.2f} of the trained block matrices are whole on every rank"
    if kept_whole and 1 - whole < 1 / tp + KEPT_WHOLE_MARGIN:
        return (
            f"with an attention kept whole only {1 - whole:.2f} of the trained block matrices are split (a pass "
            f"splits {1 / tp + KEPT_WHOLE_MARGIN:.2f})"
        )
    return ""


def has_block_linears(model) -> bool:
    """Whether a Linear (or Hugging Face Conv1D) lies inside one of `model`'s repeated blocks."""
    from tp_train.plan.deciding.coverage import in_block
    from tp_train.plan.styles import linear_shape

    return any(
        linear_shape(module) is not None and in_block(model, f"{name}.weight") for name, module in model.named_modules()
    )


def _block_share(model, reference) -> tuple[float, str]:
    """The fraction of the elements of the block matrices that train that this rank holds whole (parameters of two
    or more dims inside a repeated block, `in_block`, that holds a Linear, and that got a gradient: a vision tower a
    text batch never reaches does not count, nor a convolutional stem's numbered layers, nor a convolution wider than
    1 x 1, which no column or row style splits: PVT's sequence reduction), and the first such one. The
    blocks are read on the unsharded `reference`: its Linears, not the sharded model's swapped layers (GPT-2's Conv1D
    layers become parallel ones no block test knows, which left nothing counted)."""
    from tp_train.plan.deciding.coverage import in_block

    reference_params = dict(reference.named_parameters())
    whole = full = 0
    first = ""
    for name, param in model.named_parameters():
        expected = reference_params[name]
        counted = in_block(reference, name) and _in_linear_block(reference, name) and not _spatial(reference, name)
        if param.dim() >= 2 and expected.grad is not None and counted:
            full += expected.numel()
            if param.numel() == expected.numel():
                whole, first = whole + param.numel(), first or name
    return whole / max(full, 1), first


def _spatial(model, name: str) -> bool:
    """Whether parameter `name` belongs to a convolution whose kernel is wider than 1 (a spatial mixer)."""
    from torch.nn.modules.conv import _ConvNd

    owner = model.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, _ConvNd) and any(size > 1 for size in owner.kernel_size)


def _in_linear_block(model, name: str) -> bool:
    """Whether parameter `name`'s repeated block (its first numbered module) holds a Linear: a transformer block,
    not a numbered convolution of a feature encoder (SpeechT5's) or a stage's patch embedding (PVT's)."""
    from tp_train.plan.styles import linear_shape

    parts = name.split(".")
    index = next(i for i, part in enumerate(parts) if part.isdigit())
    block = model.get_submodule(".".join(parts[: index + 1]))
    return any(linear_shape(module) is not None for module in block.modules())
