"""`TensorParallelStrategy`: Megatron-style tensor parallelism (x data parallelism) for Lightning."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed import ProcessGroup
from torch.distributed.distributed_c10d import default_pg_timeout
from typing_extensions import override

from tp_train.checkpoint import consolidated
from tp_train.lightning.arguments import check_arguments, check_fused_loss, check_pipeline_arguments, check_shard_size
from tp_train.lightning.checkpoint_hooks import CheckpointHooks
from tp_train.lightning.example_input import example_inputs
from tp_train.lightning.launch import LaunchHooks
from tp_train.lightning.loss import StrategyLoss
from tp_train.lightning.mesh_groups import MeshGroups
from tp_train.lightning.pipeline import PipelineSteps, step_runner
from tp_train.lightning.precision import fsdp_mixed_precision_policy, tensor_parallel_precision
from tp_train.lightning.step_hooks import StepHooks
from tp_train.lightning.steps import ModelSteps
from tp_train.parallel.dims import ParallelDims
from tp_train.parallel.invariant import FAST, INVARIANT
from tp_train.parallel.mesh import backend_with_timeout
from tp_train.plan.meta_init import deferred_init
from tp_train.training import ParallelTraining, TrainingOptions, parallelize_for_training
from tp_train.training.apply_order import check_invariant_dims
from tp_train.training.experts import check_expert_parallel_arguments


class TensorParallelStrategy(StepHooks, MeshGroups, LaunchHooks, CheckpointHooks, DDPStrategy):
    """Shards the LightningModule's model(s) column-then-row over `tensor_parallel_size` ranks; the remaining
    factor of the world size is data parallelism.

    Args:
        tensor_parallel_size: ranks per tensor-parallel group; must divide devices x num_nodes.
        plan: an explicit plan for the whole LightningModule (names relative to it). By default every submodule
            with a plan of its own is sharded; with none, the auto-planner plans the LightningModule.
        sequence_parallel: shard the residual stream between the blocks along the sequence across the TP group
            (see `tp_train.parallelize`).
        activation_checkpointing: recompute each transformer block in backward instead of storing its activations.
        process_group_backend: "nccl" on GPUs, "gloo" on CPU by default.
        timeout: collective timeout, so a rank that died fails the job instead of hanging it.
        start_method: "popen" (re-run the script per rank), or "spawn" / "fork" (e.g. from a notebook or pytest).
        loss_parallel: keep the LM head's logits sharded along the vocabulary; compute the loss with
            `strategy.cross_entropy(logits, targets)`, which then never gathers them (Megatron's vocab-parallel
            cross-entropy). `CausalLMModule` does this by default; your own LightningModule calls
            `self.trainer.strategy.cross_entropy` where it called `F.cross_entropy`.
        fused_loss: with `loss_parallel`, compute the LM head and the loss together, chunk by chunk of tokens, so the
            logits never exist (`tp_train.parallel.fused_cross_entropy`); in training and validation steps only.
            Default None: when the LightningModule sets `head_feeds_only_loss = True` (`CausalLMModule` does), and
            not with `data_parallel="fsdp"`.
        compile: compile each sharded model with `torch.compile` (see `tp_train.parallelize`'s `compile`): no graph
            break for a model without dropout.
        overlap: overlap each column-parallel layer's input-gradient collective with its weight gradient in backward
            (see `tp_train.parallelize`'s `overlap`). Default None: on with NCCL, off with gloo.
        verify_plan: check each sharded model before training (see `tp_train.parallelize`'s `verify`): each
            swapped module against the one it replaced, and the whole model against the unsharded one when it is
            small. Default None: on for every plan; True also forces the whole-model check; False: off.
        async_checkpoint: write checkpoints in the background (`tp_train.AsyncCheckpointWriter`):
            saving blocks a step only while the state is copied; the previous checkpoint stays whole until the new
            one is complete. False writes before the step continues.
        trust_checkpoint: load checkpoints that hold more than data (pickled objects, which could run code) as
            torch would; only for your own checkpoints. By default such a checkpoint is refused in one line.
        save_distributed_checkpoint: True: a directory of every rank's shards. False (Lightning's meaning): one file
            of the full state, written by rank 0, that `MyModule.load_from_checkpoint` reads in a plain process
            (`tp_train.checkpoint.consolidated`); `fit(ckpt_path=...)` loads either, at any tp.
        data_parallel: "ddp" (replicate each tensor-parallel shard over the data-parallel ranks) or "fsdp" (shard
            it, with its gradients and optimizer states, over them: about 1/dp of the model state per rank, for
            one all-gather per block forward and backward and a reduce-scatter in place of DDP's all-reduce).
        data_parallel_shard_size: with "fsdp", the data-parallel ranks each shard is split over (HSDP): groups of
            that many ranks each hold one copy of the model state, split between them, and the groups replicate it
            (gradients reduce-scattered within a group, then all-reduced across the groups). It divides the
            data-parallel ranks of a node, so a group's every-block all-gathers stay within the node. Default None:
            all of the data-parallel ranks (FSDP).
        context_parallel_size: ranks per context-parallel group, each holding a load-balanced share of every
            sequence (devices = dp x cp x tp; the block size must be a multiple of 2 x cp); attention runs across them.
        context_parallel_rotation: how keys and values reach every context-parallel rank: "ring" (passed rank to
            rank, two shares in memory) or "allgather" (gathered at once); or "alltoall" (DeepSpeed-Ulysses: q, k,
            v traded for 1/cp of the heads over the whole sequence; the heads per tensor-parallel rank must divide
            by cp).
        expert_parallel_size: ranks among which each mixture-of-experts layer's experts are split, whole experts per
            rank, tokens sent to their experts' ranks (all-to-all): a view over the data x context parallel ranks
            (it divides dp x cp and does not add ranks); the experts' gradients are averaged over the ranks holding
            the same experts (`tp_train.lightning.experts`, docs/experts.md).
        expert_capacity_factor: None (dropless) or, with expert parallelism, the tokens each expert takes from each
            rank per layer, as a multiple of an even share (`tp_train.parallel.experts.expert_capacity`); those over
            it are dropped and counted (`train/moe/dropped_<layer>`).
        numerics: "fast", or "invariant": every sum a layout splits is computed in one fixed order, so the run's
            losses and weights are the same bits at every tensor- and data-parallel degree (DDP's): each step runs
            the user's training_step once per leaf of the batch (docs/invariant-numerics.md; fp32, fp64 or
            bf16-mixed; slower).
        **kwargs: passed to torch's DistributedDataParallel for the data-parallel axis (with "ddp").
    """

    strategy_name = "tensor_parallel"

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        plan: dict[str, str] | None = None,
        sequence_parallel: bool = False,
        activation_checkpointing: bool = False,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        verify_plan: bool | None = None,
        data_parallel: str = "ddp",
        data_parallel_shard_size: int | None = None,
        loss_parallel: bool = False,
        fused_loss: bool | None = None,
        compile: bool = False,
        overlap: bool | None = None,
        async_checkpoint: bool = True,
        trust_checkpoint: bool = False,
        save_distributed_checkpoint: bool = True,
        context_parallel_size: int = 1,
        context_parallel_rotation: str = "ring",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: str = "1f1b",
        pipeline_microbatches: int | None = None,
        pipeline_split: list[int] | None = None,
        pipeline_virtual_stages: int = 1,
        expert_parallel_size: int = 1,
        expert_capacity_factor: float | None = None,
        numerics: str = FAST,
        **kwargs: Any,
    ) -> None:
        check_arguments(tensor_parallel_size, context_parallel_size, context_parallel_rotation, data_parallel, kwargs)
        check_shard_size(data_parallel_shard_size, data_parallel)
        check_expert_parallel_arguments(expert_parallel_size, expert_capacity_factor)
        check_pipeline_arguments(pipeline_parallel_size, pipeline_schedule, pipeline_microbatches,
                                 pipeline_virtual_stages)  # fmt: skip
        consolidated.check_data_parallel(save_distributed_checkpoint, data_parallel)
        consolidated.check_pipeline_parallel(save_distributed_checkpoint, pipeline_parallel_size)
        check_fused_loss(fused_loss, data_parallel, numerics)
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs
        )
        # the degrees (`parallel_dims`, at the world size) and how each dimension is applied (`options`)
        self.tensor_parallel_size, self.context_parallel_size = tensor_parallel_size, context_parallel_size
        self.pipeline_parallel_size, self.pipeline_virtual_stages = pipeline_parallel_size, pipeline_virtual_stages
        self.expert_parallel_size, self.data_parallel_shard_size = expert_parallel_size, data_parallel_shard_size
        self.options = TrainingOptions(
            plan=plan, verify_plan=verify_plan, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel,
            activation_checkpointing=activation_checkpointing, compile=compile, overlap=overlap,
            data_parallel=data_parallel, context_parallel_rotation=context_parallel_rotation,
            pipeline_schedule=pipeline_schedule, pipeline_microbatches=pipeline_microbatches,
            pipeline_split=pipeline_split,
            expert_capacity_factor=expert_capacity_factor, numerics=numerics,
            fsdp_methods=("training_step", "validation_step", "test_step", "predict_step"),
        )  # fmt: skip
        self.async_checkpoint, self.trust_checkpoint = async_checkpoint, trust_checkpoint
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._parallel: ParallelTraining | None = None  # the model as parallelized (setup)
        self._steps: ModelSteps | PipelineSteps = ModelSteps()  # how the step hooks run the user's steps (setup)
        self._loss = StrategyLoss(fused_loss, compile, context_parallel=context_parallel_size > 1, numerics=numerics)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The job's degrees: these arguments at the world size (validated in `setup_environment`)."""
        return ParallelDims.from_world(
            self.world_size, tp=self.tensor_parallel_size, cp=self.context_parallel_size,
            pp=self.pipeline_parallel_size, ep=self.expert_parallel_size, data_parallel=self.options.data_parallel,
            virtual_stages=self.pipeline_virtual_stages, dp_shard=self.data_parallel_shard_size,
        )  # fmt: skip

    @property
    def parallel_training(self) -> ParallelTraining:
        """The model as `tp_train.training.parallelize_for_training` parallelized it (from `setup` on)."""
        if self._parallel is None:
            raise RuntimeError("the model is parallelized in the strategy's setup(); it has not run yet")
        return self._parallel

    @override
    def setup_environment(self) -> None:
        dims = self.parallel_dims
        dims.validate("devices", self.num_nodes)
        check_invariant_dims(dims, self.options.numerics, self.options.data_parallel)
        super().setup_environment()
        if self.options.numerics == INVARIANT:  # a CPU kernel's reduction order may follow its threads (LayerNorm's)
            torch.set_num_threads(1)
        # every group of the mesh times out like the world group (torch gives its sub-groups a 30-minute default)
        self._mesh = dims.build_mesh(
            self.root_device.type, backend_with_timeout(self._get_process_group_backend(), self._timeout)
        )
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None):
        # With empty_init the model is built on the meta device (the values its constructor computes kept); `setup`
        # materialises each rank's shards only.
        building = deferred_init() if empty_init else self.root_device
        with building, self.precision_plugin.tensor_init_context():
            yield

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        module = self.lightning_module
        if not any(t.is_meta for t in module.parameters()):
            self.model_to_device()  # shard on the device: the collectives below run on it
        fitting = trainer.state.fn == TrainerFn.FITTING
        separator = getattr(trainer.datamodule, "document_separator", None)  # attention within documents
        options = replace(self.options, document_separator=separator)
        self._parallel = parallelize_for_training(
            module, self.parallel_dims, self.mesh, self.root_device, options,
            example_inputs=partial(example_inputs, trainer, module, group=self.tensor_parallel_group),
            convert=self.precision_plugin.convert_module, mp_policy=fsdp_mixed_precision_policy(self.precision_plugin),
            wrap_replicas=self._replicate if fitting else None,
        )  # fmt: skip
        self.model = self._parallel.module
        self._loss.loss_parallel = self._parallel.loss_parallel  # what sharding decided; `options` holds the request
        if self.options.loss_parallel and not self._parallel.loss_parallel:
            rank_zero_info(
                "loss_parallel off: the loss takes the whole logits (under a pipeline, or with no LM head planned "
                "'colwise_gather_output': the model's get_output_embeddings() whole under its plan)"
            )
        self._steps = step_runner(self, self._parallel)  # through the pipeline's schedule where it has one
        self.precision_plugin.clipping = self._parallel.clipping()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else tensor_parallel_precision(Precision())

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Precision | None) -> None:
        self._precision_plugin = None if precision_plugin is None else tensor_parallel_precision(precision_plugin)

    def _replicate(self, module: torch.nn.Module, group: ProcessGroup) -> torch.nn.Module:
        """Lightning's DDP around `module`, with this strategy's DDP arguments (its process group: `group`, the data x
        context parallel ranks) and communication hooks."""
        self._ddp_kwargs["process_group"] = group
        self.model = self._setup_model(module)
        self._register_ddp_hooks()
        return self.model

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"{cls.__name__} ({start_method})", start_method=start_method
                )


TensorParallelStrategy.register_strategies(StrategyRegistry)  # strategy="tensor_parallel"
