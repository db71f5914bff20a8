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


def init_mismatches(eager: dict, built: dict) -> list[str]:
    """The tensors of `eager` (name -> tensor) that `built` lacks or holds otherwise drawn, one line each. A tensor of
    n elements matches in distribution when |std ratio - 1| <= 4 / sqrt(2n) and its mean is within 4 std sqrt(2 / n)
    of eager's (four standard errors of the difference of two samples' means); one that is not floating point, has
    one element or is constant in the eager build must be equal."""
    found = []
    for name, expected in eager.items():
        actual = built.get(name)
        if actual is None:
            found.append(f"{name}: missing from the sharded model")
            continue
        if actual.shape != expected.shape:
            found.append(f"{name}: shape {tuple(expected.shape)} -> {tuple(actual.shape)}")
            continue
        if not expected.is_floating_point() or expected.numel() < 2 or expected.double().std() == 0:
            if not _equal(actual, expected):
                found.append(f"{name}: a constant tensor, not equal")
            continue
        expected, actual = expected.double(), actual.double()
        n, std = expected.numel(), expected.std()
        ratio, mean_off = actual.std() / std, abs(actual.mean() - expected.mean())
        if not (abs(ratio - 1) <= 4 / math.sqrt(2 * n) and mean_off <= 4 * std * math.sqrt(2 / n)):  # NaN differs
            found.append(
                f"{name}: std {std:.4g} -> {actual.std():.4g}, mean {expected.mean():.4g} -> {actual.mean():.4g}"
            )
    return found


def _equal(actual, expected) -> bool:
    """Equal values, NaN equal to NaN (a buffer an eager build leaves NaN where it is unused)."""
    import torch

    return torch.equal(actual, expected) or (
        expected.is_floating_point() and torch.equal(actual.nan_to_num(), expected.nan_to_num())
    )


def check_init(model_type: str, task: str = "causal-lm", fields: dict | None = None) -> dict:
    """On one rank of an initialised process group: {"class", "reason"} for the family's meta-built, sharded model
    against its eager build (`INIT_CLASSES`): `match`, `differs` (the differing tensors, `init_mismatches`), `refused`
    or `error` (its sharding failed: the parity check's classes), `unbuildable` (its eager build failed). Every rank
    must call it (the sharded tensors are gathered)."""
    import torch
    import torch.distributed as dist

    import tp_train
    from tp_train.errors import first_line

    torch.manual_seed(0)
    try:
        eager = build_family(task, model_type, fields)
    except Exception as error:  # noqa: BLE001 - a family this config cannot build is not counted
        return {"class": "unbuildable", "reason": first_line(error)}
    expected = {name: tensor.detach() for name, tensor in _tensors(eager).items()}
    torch.manual_seed(0)
    try:
        with tp_train.deferred_init():
            model = build_family(task, model_type, fields)
        with contextlib.redirect_stdout(io.StringIO()):
            tp_train.parallelize(model, device="cpu", verify=False)
    except (ValueError, tp_train.PlanVerificationError) as error:
        return {"class": "refused", "reason": first_line(error)}
    except Exception as error:  # noqa: BLE001
        return {"class": "error", "reason": f"meta build and parallelize: {type(error).__name__}: {first_line(error)}"}
    built = {**_tensors(model), **tp_train.full_state_dict(model, dist.group.WORLD)}
    found = init_mismatches(expected, built)
    if found:
        shown = "; ".join(found[:SHOWN]) + (f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else "")
        return {"class": "differs", "reason": f"{len(found)} of {len(expected)} tensors: {shown}", "tensors": found}
    constant = sum(_constant(tensor) for tensor in expected.values())
    return {"class": "match", "reason": f"{len(expected)} tensors ({constant} constant, equal) as eager's"}


def _tensors(model) -> dict:
    """`model`'s parameters and buffers by name (a buffer outside its state dict too: rotary frequencies)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def _constant(tensor) -> bool:
    return not tensor.is_floating_point() or tensor.numel() < 2 or bool(tensor.double().std() == 0)


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
