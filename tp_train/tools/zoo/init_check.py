"""The zoo's init column (`python -m tp_train.tools.zoo --init`, issue 54): a family built under
`tp_train.deferred_init()` (what `train.py`'s `init_module(empty_init=True)` does) and sharded with no plan given
starts from the weights its eager build draws. Each parameter's and buffer's mean and standard deviation, gathered
whole, are compared with an eager build of the same tiny config from the same seed, within a tolerance that scales with
the tensor's size and still catches a lost rule on the tiny shapes; a constant tensor (zeros, ones, a computed buffer)
is compared exactly."""

from __future__ import annotations

import contextlib
import io
import math

from tp_train.tools.zoo.configs import build_family

INIT_CLASSES = ("match", "differs", "refused", "error", "killed", "unbuildable")
SHOWN = 3  # differing tensors named in a family's reason
RECHECK_SEEDS = 8  # more builds of each, pooled, for a drawn tensor that differs at seed 0


def init_mismatches(eager: dict, built: dict) -> dict[str, str]:
    """{name: how it differs} for each tensor of `eager` (name -> tensor) that `built` lacks or holds otherwise drawn.
    A tensor of n elements matches in distribution when |std ratio - 1| <= 4 / sqrt(2n) and its mean is within
    4 std sqrt(2 / n) of eager's (four standard errors of the difference of two samples' means); one that is not
    floating point, has one element or is constant in the eager build must be equal (a NaN equal to a NaN)."""
    found = {}
    for name, expected in eager.items():
        actual = built.get(name)
        if actual is None:
            found[name] = "missing from the sharded model"
        elif actual.shape != expected.shape:
            found[name] = f"shape {tuple(expected.shape)} -> {tuple(actual.shape)}"
        elif _constant(expected):
            if not _equal(actual, expected):
                found[name] = "a constant tensor, not equal"
        else:
            expected, actual = expected.double(), actual.double()
            n, std = expected.numel(), expected.std()
            ratio, mean_off = actual.std() / std, abs(actual.mean() - expected.mean())
            if not (abs(ratio - 1) <= 4 / math.sqrt(2 * n) and mean_off <= 4 * std * math.sqrt(2 / n)):  # NaN differs
                found[name] = f"std {std:.4g} -> {actual.std():.4g}, mean {expected.mean():.4g} -> {actual.mean():.4g}"
    return found


def check_init(model_type: str, task: str = "causal-lm", fields: dict | None = None) -> dict:
    """On one rank of an initialised process group: {"class", "reason"} for the family's meta-built, sharded model
    against its eager build from the same seed (`INIT_CLASSES`): `match`, `differs` (`init_mismatches`: "tensors"
    names each), `refused` or `error` (its sharding failed: the parity check's classes), `unbuildable` (its eager
    build failed). A drawn tensor that differs is compared again over `RECHECK_SEEDS` more builds of each, pooled: the
    same seed does not draw the same numbers (the meta build draws in another order), and a tensor differs by chance
    at that bar once in a few hundred (a 4-element attention sink once in ten); a lost rule differs at every seed.
    Every rank must call it (the sharded tensors are gathered; every rank decides alike)."""
    import tp_train
    from tp_train.errors import first_line

    try:
        expected = _eager(task, model_type, fields, seed=0)
    except Exception as error:  # noqa: BLE001 - a family this config cannot build is not counted
        return {"class": "unbuildable", "reason": first_line(error)}
    try:
        built = _meta_built(task, model_type, fields, seed=0)
        found = init_mismatches(expected, built)
        chance = {name: found.pop(name) for name in list(found) if _drawn_alike(expected[name], built.get(name))}
        if chance:
            found |= _pooled_recheck(task, model_type, fields, chance)
    except (ValueError, tp_train.PlanVerificationError) as error:
        return {"class": "refused", "reason": first_line(error)}
    except Exception as error:  # noqa: BLE001
        return {"class": "error", "reason": f"meta build and parallelize: {type(error).__name__}: {first_line(error)}"}
    if found:
        lines = [f"{name}: {how}" for name, how in found.items()]
        shown = "; ".join(lines[:SHOWN]) + (f"; and {len(lines) - SHOWN} more" if len(lines) > SHOWN else "")
        return {"class": "differs", "reason": f"{len(lines)} of {len(expected)} tensors: {shown}", "tensors": lines}
    constant = sum(_constant(tensor) for tensor in expected.values())
    reason = f"{len(expected)} tensors ({constant} constant, equal) as eager's"
    if chance:
        reason += f"; {len(chance)} apart at seed 0 matched over {RECHECK_SEEDS} more seeds ({', '.join(chance)})"
    return {"class": "match", "reason": reason}


def _pooled_recheck(task: str, model_type: str, fields: dict | None, differing: dict[str, str]) -> dict[str, str]:
    """{name: how it differs} for the tensors of `differing` still apart with the values of `RECHECK_SEEDS` more
    eager and meta builds (seeds 1, 2, ...) pooled, each tensor's n elements becoming n x `RECHECK_SEEDS`."""
    import torch

    eager, built = {name: [] for name in differing}, {name: [] for name in differing}
    for seed in range(1, RECHECK_SEEDS + 1):
        for pooled, tensors in ((eager, _eager(task, model_type, fields, seed)),
                                (built, _meta_built(task, model_type, fields, seed))):  # fmt: skip
            for name in differing:
                pooled[name].append(tensors[name].flatten())
    still = init_mismatches(
        {name: torch.cat(values) for name, values in eager.items()},
        {name: torch.cat(values) for name, values in built.items()},
    )
    return {name: f"{differing[name]}; over {RECHECK_SEEDS} more seeds pooled, {how}" for name, how in still.items()}


def _eager(task: str, model_type: str, fields: dict | None, seed: int) -> dict:
    """The eager build's parameters and buffers, drawn from `seed`."""
    import torch

    torch.manual_seed(seed)
    return {name: tensor.detach() for name, tensor in _tensors(build_family(task, model_type, fields)).items()}


def _meta_built(task: str, model_type: str, fields: dict | None, seed: int) -> dict:
    """The parameters and buffers of the family built under `deferred_init` from `seed` and sharded over the world
    with no plan given, each split one gathered whole on every rank (a collective)."""
    import torch
    import torch.distributed as dist

    import tp_train

    torch.manual_seed(seed)
    with tp_train.deferred_init():
        model = build_family(task, model_type, fields)
    with contextlib.redirect_stdout(io.StringIO()):
        tp_train.parallelize(model, device="cpu", verify=False)
    tensors = {name: tensor.detach() for name, tensor in _tensors(model).items()}
    sharded = list(tp_train.named_sharded_parameters(model, buffers=True))  # Falcon-H1's mup_vector too
    gathered = tp_train.unshard_tensors([(tensor.detach(), spec) for _, tensor, spec in sharded], dist.group.WORLD)
    tensors.update({name: full for (name, _, _), full in zip(sharded, gathered, strict=True)})
    return tensors


def _tensors(model) -> dict:
    """`model`'s parameters and buffers by name (a buffer outside its state dict too: rotary frequencies)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _drawn_alike(expected, actual) -> bool:
    """Whether a tensor the eager build draws (not constant) is held by the sharded model in the same shape."""
    return actual is not None and actual.shape == expected.shape and not _constant(expected)


def _constant(tensor) -> bool:
    return not tensor.is_floating_point() or tensor.numel() < 2 or bool(tensor.double().std() == 0)


def _equal(actual, expected) -> bool:
    """Equal values, NaN equal to NaN (a buffer an eager build leaves NaN where it is unused)."""
    import torch

    return torch.equal(actual, expected) or (
        expected.is_floating_point() and torch.equal(actual.nan_to_num(), expected.nan_to_num())
    )


def init_summary(results: dict[str, dict], tp: int) -> str:
    """The counts per class, then every family that does not match, with its reason."""
    counts = {name: sum(r["class"] == name for r in results.values()) for name in INIT_CLASSES}
    built = len(results) - counts["unbuildable"]
    lines = [
        f"{counts['match']} of {built} buildable families match their eager initialisation at tp={tp}; "
        + ", ".join(f"{name} {counts[name]}" for name in INIT_CLASSES[1:-1])
        + f"; {counts['unbuildable']} not buildable from a tiny config"
    ]
    for name in INIT_CLASSES[1:]:
        for family, result in sorted(results.items()):
            if result["class"] == name:
                lines.append(f"{name:<11} {family:<26} {result['reason']}")
    return "\n".join(lines)
