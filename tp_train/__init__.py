"""tp_train: Megatron-style tensor parallelism for PyTorch Lightning."""

from lightning.pytorch.strategies import StrategyRegistry

from tp_train.autoplan import infer_plan
from tp_train.callbacks import TrainingMetrics
from tp_train.checkpoint import load as load_checkpoint
from tp_train.checkpoint import save as save_checkpoint
from tp_train.checkpoint_checks import CheckpointError
from tp_train.clipping import clip_grad_norm_, global_grad_norm
from tp_train.comm import (
    CommunicationCounter,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)
from tp_train.cross_entropy import vocab_parallel_cross_entropy
from tp_train.data import TextDataModule
from tp_train.export_hf import export_hugging_face
from tp_train.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tp_train.memory import estimate_memory
from tp_train.module import CausalLMModule
from tp_train.nonfinite import NonFiniteError, NonFiniteGuard
from tp_train.parallelize import parallelize
from tp_train.precision import TensorParallelMixedPrecision
from tp_train.preemption import Preempted, PreemptionCheckpoint
from tp_train.pretrained import load_pretrained
from tp_train.random import TensorParallelRNG
from tp_train.resumable_loader import ResumableDataLoader, ResumableDistributedSampler
from tp_train.rng_state import RandomStateCheckpoint
from tp_train.schedulers import cosine_with_warmup
from tp_train.sharding import ShardSpec, full_state_dict, named_sharded_parameters, unshard_tensor
from tp_train.strategy import TensorParallelStrategy
from tp_train.verify import PlanVerificationError, verify_parallelized

TensorParallelStrategy.register_strategies(StrategyRegistry)  # strategy="tensor_parallel"

__all__ = [
    "CausalLMModule",
    "CheckpointError",
    "CommunicationCounter",
    "ColumnParallelLinear",
    "NonFiniteError",
    "NonFiniteGuard",
    "PlanVerificationError",
    "Preempted",
    "PreemptionCheckpoint",
    "RandomStateCheckpoint",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "RowParallelLinear",
    "ShardSpec",
    "TensorParallelMixedPrecision",
    "TensorParallelRNG",
    "TensorParallelStrategy",
    "TextDataModule",
    "TrainingMetrics",
    "VocabParallelEmbedding",
    "clip_grad_norm_",
    "copy_to_tensor_parallel_region",
    "cosine_with_warmup",
    "estimate_memory",
    "export_hugging_face",
    "full_state_dict",
    "gather_from_sequence_parallel_region",
    "global_grad_norm",
    "infer_plan",
    "load_checkpoint",
    "load_pretrained",
    "gather_from_tensor_parallel_region",
    "named_sharded_parameters",
    "parallelize",
    "reduce_from_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "save_checkpoint",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_parallel_region",
    "unshard_tensor",
    "verify_parallelized",
    "vocab_parallel_cross_entropy",
]
