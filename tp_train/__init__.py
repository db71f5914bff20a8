"""tp_train: Megatron-style tensor parallelism for PyTorch Lightning.

The Lightning half (the strategy, its plugins and callbacks, the app's module and data) is imported on first use of
one of its names, so a plain PyTorch program (`tp_train.training.parallelize_for_training`, `tp_train.parallelize`)
never imports Lightning. Importing the strategy registers it with Lightning as `strategy="tensor_parallel"`.
"""

import importlib
from typing import Any

from tp_train.checkpoint.async_writer import AsyncCheckpointWriter
from tp_train.checkpoint.dcp import load as load_checkpoint
from tp_train.checkpoint.dcp import save as save_checkpoint
from tp_train.checkpoint.pretrained import load_pretrained
from tp_train.errors import CheckpointError, NonFiniteError
from tp_train.parallel.clipping import clip_grad_norm_, global_grad_norm
from tp_train.parallel.collectives import (
    CommunicationCounter,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.parallel.experts import shard_experts
from tp_train.parallel.fused_cross_entropy import vocab_parallel_linear_cross_entropy
from tp_train.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tp_train.parallel.pipeline import Pipeline
from tp_train.parallel.pipeline.split import PipelineSplit
from tp_train.parallel.random import TensorParallelRNG
from tp_train.parallel.sharding import (
    ShardSpec,
    full_state_dict,
    named_sharded_parameters,
    unshard_tensor,
    unshard_tensors,
)
from tp_train.plan.checking.verify import PlanVerificationError, verify_parallelized
from tp_train.plan.deciding.autoplan import infer_plan
from tp_train.plan.meta_init import deferred_init
from tp_train.plan.parallelize import parallelize
from tp_train.tools.export import export_hugging_face
from tp_train.tools.generation import Sampling, generate
from tp_train.tools.memory import estimate_memory
from tp_train.tools.simulate import SimulatedMemory, SimulatedStep, simulate_memory, simulate_step
from tp_train.training.data_parallel import fully_shard_data_parallel
from tp_train.training.pipeline_split import plan_pipeline_split

# name -> (module, attribute): the Lightning half, imported by `__getattr__` on first use
_LIGHTNING_NAMES = {
    "CausalLMModule": ("tp_train.app.module", "CausalLMModule"),
    "DataPosition": ("tp_train.lightning.data_position", "DataPosition"),
    "HangDetector": ("tp_train.lightning.hang", "HangDetector"),
    "NonFiniteGuard": ("tp_train.lightning.nonfinite", "NonFiniteGuard"),
    "Preempted": ("tp_train.lightning.preemption", "Preempted"),
    "PreemptionCheckpoint": ("tp_train.lightning.preemption", "PreemptionCheckpoint"),
    "RandomStateCheckpoint": ("tp_train.lightning.rng_state", "RandomStateCheckpoint"),
    "ResumableDataLoader": ("tp_train.lightning.resumable_loader", "ResumableDataLoader"),
    "ResumableDistributedSampler": ("tp_train.lightning.resumable_loader", "ResumableDistributedSampler"),
    "TensorParallelMixedPrecision": ("tp_train.lightning.precision", "TensorParallelMixedPrecision"),
    "TensorParallelStrategy": ("tp_train.lightning.strategy", "TensorParallelStrategy"),
    "TextDataModule": ("tp_train.app.data", "TextDataModule"),
    "TrainingMetrics": ("tp_train.lightning.metrics", "TrainingMetrics"),
    "ValidationSamples": ("tp_train.app.samples", "ValidationSamples"),
    "WandbLogger": ("tp_train.lightning.wandb_logger", "WandbLogger"),
    "constant_with_warmup": ("tp_train.app.schedulers", "constant_with_warmup"),
    "cosine_with_warmup": ("tp_train.app.schedulers", "cosine_with_warmup"),
}


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING_NAMES:
        raise AttributeError(f"module 'tp_train' has no attribute '{name}'")
    module, attribute = _LIGHTNING_NAMES[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


__all__ = [
    "AsyncCheckpointWriter",
    "CausalLMModule",
    "CheckpointError",
    "CommunicationCounter",
    "ColumnParallelLinear",
    "DataPosition",
    "HangDetector",
    "NonFiniteError",
    "NonFiniteGuard",
    "ParallelDims",
    "ParallelMesh",
    "Pipeline",
    "PipelineSplit",
    "PlanVerificationError",
    "Preempted",
    "PreemptionCheckpoint",
    "RandomStateCheckpoint",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "RowParallelLinear",
    "Sampling",
    "ShardSpec",
    "SimulatedMemory",
    "SimulatedStep",
    "TensorParallelMixedPrecision",
    "TensorParallelRNG",
    "TensorParallelStrategy",
    "TextDataModule",
    "TrainingMetrics",
    "ValidationSamples",
    "WandbLogger",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "copy_to_tensor_parallel_region",
    "constant_with_warmup",
    "cosine_with_warmup",
    "deferred_init",
    "estimate_memory",
    "export_hugging_face",
    "full_state_dict",
    "fully_shard_data_parallel",
    "generate",
    "gather_from_sequence_parallel_region",
    "global_grad_norm",
    "infer_plan",
    "load_checkpoint",
    "load_pretrained",
    "gather_from_tensor_parallel_region",
    "named_sharded_parameters",
    "parallelize",
    "plan_pipeline_split",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "save_checkpoint",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "shard_experts",
    "simulate_memory",
    "simulate_step",
    "unshard_tensor",
    "unshard_tensors",
    "verify_parallelized",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
]
