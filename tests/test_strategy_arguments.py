"""TensorParallelStrategy refuses a wrong argument at construction, in one line naming it and what would work."""

from __future__ import annotations

import pytest

from tp_train import TensorParallelStrategy


@pytest.mark.parametrize(
    "arguments, error, message",
    [
        ({"tensor_parallel_size": 0}, ValueError, "tensor_parallel_size=0 must be a positive integer"),
        ({"context_parallel_size": 1.5}, ValueError, "context_parallel_size=1.5 must be a positive integer"),
        ({"data_parallel": "zero3"}, ValueError, "data_parallel='zero3': use 'ddp' (replicated tensor-parallel"),
        ({"data_parallel": "fsdp", "bucket_cap_mb": 5}, TypeError, "got DistributedDataParallel arguments"),
        ({"bucket_cap": 5}, TypeError, "TensorParallelStrategy got unknown arguments ['bucket_cap']; other keyword"),
        (
            {"context_parallel_rotation": "ulysses"},
            ValueError,
            "rotation='ulysses'): use one of 'ring', 'allgather', 'alltoall'",
        ),
        ({"data_parallel": "fsdp", "fused_loss": True}, ValueError, "fused_loss=True) with data_parallel='fsdp'"),
        ({"data_parallel_shard_size": 2}, ValueError, "data_parallel_shard_size=2 with data_parallel=ddp: HSDP needs"),
        ({"data_parallel": "fsdp", "data_parallel_shard_size": 0}, ValueError, "data_parallel_shard_size=0 must be a"),
    ],
    ids=[
        "tp",
        "cp",
        "data_parallel",
        "fsdp_with_ddp_arguments",
        "unknown",
        "rotation",
        "fused_loss_with_fsdp",
        "shard_size_with_ddp",
        "shard_size_zero",
    ],
)
def test_a_wrong_argument_is_refused_in_one_line(arguments, error, message):
    with pytest.raises(error) as refused:
        TensorParallelStrategy(**arguments)
    assert message in str(refused.value) and "\n" not in str(refused.value), refused.value


def test_the_arguments_users_pass_are_accepted():
    strategy = TensorParallelStrategy(
        tensor_parallel_size=2, context_parallel_size=2, context_parallel_rotation="alltoall", bucket_cap_mb=5
    )
    assert (strategy.tensor_parallel_size, strategy.options.context_parallel_rotation) == (2, "alltoall")
