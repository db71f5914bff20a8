"""What a parallel layer costs per step at tp=1 against the torch layer it replaced: the same aten operators, so a
user who adds tensor parallelism does not pay for it on one device (the row-parallel bias inside the matmul, the
embedding's plain lookup, no slice of an unpadded head), the whole sharded GPT as the plain one; and no random-stream
switching for a model without dropout."""

from __future__ import annotations

import functools
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.distributed import run_on_ranks


class _Operators(TorchDispatchMode):
    """The aten operators called while the mode is on, in order."""

    def __init__(self):
        super().__init__()
        self.called = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.called.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _operators(layer: nn.Module, x: torch.Tensor, grad_input: bool = True) -> list[str]:
    x = x.clone().requires_grad_(grad_input)
    with _Operators() as mode:
        layer(x).sum().backward()
    return mode.called


def _python_calls(model: nn.Module, idx: torch.Tensor) -> list[str]:
    """The Python functions called (file:function) during one forward and backward, after a first one."""
    model(idx).sum().backward()
    called = []

    def record(frame, event, _):
        if event == "call":
            called.append(f"{frame.f_code.co_filename}:{frame.f_code.co_name}")

    sys.setprofile(record)
    try:
        model(idx).sum().backward()
    finally:
        sys.setprofile(None)
    return called


def _model_costs(rank, world_size):
    import copy

    import tp_train
    from models import GPT, GPTConfig
    from tp_train.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

    torch.manual_seed(0)
    plain = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16))
    ours = tp_train.parallelize(copy.deepcopy(plain), dist.group.WORLD, verify=False)
    idx = torch.randint(0, 64, (2, 8))
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    return {
        "layers": _layer_operators(),  # the single layers' check shares this start-up
        "operators": {
            name: _operators(model, idx, grad_input=False) for name, model in (("plain", plain), ("ours", ours))
        },
        "calls": {name: _python_calls(model, idx) for name, model in (("plain", plain), ("ours", ours))},
        "parallel_layers": sum(isinstance(module, parallel) for module in ours.modules()),
    }


@functools.cache
def _costs_at_tp1():
    [costs] = run_on_ranks(_model_costs, 1)
    return costs


def test_a_sharded_gpt_at_tp1_runs_the_operators_of_the_plain_one():
    """Forward and backward of the whole model (its loss aside): no mask, slice or add that plain does not do, and
    in Python only its layers' own calls: none into torch.distributed (group sizes are read from the group object,
    not `dist.get_world_size`'s 11 calls per collective wrapper), at most 3 more calls per parallel layer than plain
    (its forward, the region entry and `f`; 36 for 14 layers, against 102 before)."""
    costs = _costs_at_tp1()
    operators, calls = costs["operators"], costs["calls"]
    assert operators["ours"] == operators["plain"], (len(operators["ours"]), len(operators["plain"]))
    assert [call for call in calls["ours"] if "torch/distributed" in call] == []
    extra = len(calls["ours"]) - len(calls["plain"])
    assert 0 < extra <= 3 * costs["parallel_layers"], (extra, costs["parallel_layers"])


def _layer_operators():
    from tp_train.parallel.layers import ColumnParallelLinear, RowParallelLinear

    group, x = dist.group.WORLD, torch.randn(2, 3, 8)
    reference = nn.Linear(8, 6)
    return {
        "linear": _operators(reference, x),
        "column": _operators(ColumnParallelLinear(8, 6, group), x),
        "row": _operators(RowParallelLinear(8, 6, group), x),
    }


def test_parallel_linears_at_tp1_run_the_operators_of_nn_linear():
    operators = _costs_at_tp1()["layers"]
    assert operators["column"] == operators["linear"], operators
    assert operators["row"] == operators["linear"], operators


def _stream_switches(rank, world_size):
    """Generator-state writes during one training step of a sharded GPT, without and with dropout."""
    import tp_train
    import tp_train.parallel.random as random
    from models import GPT, GPTConfig

    writes = []
    set_state = random._set_state
    random._set_state = lambda device, state: (writes.append(1), set_state(device, state))
    counts = {}
    for dropout in (0.0, 0.1):
        torch.manual_seed(0)
        config = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=dropout)
        model = tp_train.parallelize(GPT(config), dist.group.WORLD, verify=False)
        writes.clear()
        logits = model(torch.randint(0, 64, (2, 8)))
        logits.sum().backward()
        counts[dropout] = len(writes)
    return counts


def test_no_random_stream_switch_in_eager_when_the_model_draws_no_dropout():
    for counts in run_on_ranks(_stream_switches, 2):
        assert counts[0.0] == 0 and counts[0.1] > 0, counts  # the control: with dropout the streams do switch
