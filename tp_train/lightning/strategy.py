"""`TensorParallelStrategy`: Megatron-style tensor parallelism (x data parallelism) for Lightning."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.overrides.distributed import _sync_module_states
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.distributed_c10d import default_pg_timeout
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from tp_train.checkpoint import consolidated
from tp_train.checkpoint.async_writer import AsyncCheckpointWriter
from tp_train.lightning import rendezvous
from tp_train.lightning.arguments import check_arguments, check_fused_loss, check_shard_size
from tp_train.lightning.checkpoint_hooks import CheckpointHooks
from tp_train.lightning.example_input import example_inputs
from tp_train.lightning.experts import StrategyExperts
from tp_train.lightning.launch import HydraJobLauncher, ShardedMultiProcessingLauncher
from tp_train.lightning.loss import StrategyLoss, mean_over_replicas
from tp_train.lightning.pipeline import LightningPipeline, check_pipeline_arguments, decide_split
from tp_train.lightning.pipeline_hooks import PipelineStepHooks
from tp_train.lightning.precision import fsdp_mixed_precision_policy, tensor_parallel_precision
from tp_train.parallel.dims import ParallelDims, ParallelMesh
from tp_train.parallel.mesh import backend_with_timeout, first_rank_decides
from tp_train.parallel.random import sync_default_generator
from tp_train.parallel.sharding import named_sharded_parameters
from tp_train.plan.context_parallel import context_parallel_cross_entropy
from tp_train.plan.data_parallel import fully_shard_data_parallel, refuse_replicated_shards
from tp_train.plan.meta_init import deferred_init, materialize_remaining
from tp_train.plan.parallelize import attached, parallelize
from tp_train.plan.resolve import modules_with_plans


class TensorParallelStrategy(PipelineStepHooks, CheckpointHooks, DDPStrategy):
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
        **kwargs: Any,
    ) -> None:
        check_arguments(tensor_parallel_size, context_parallel_size, context_parallel_rotation, data_parallel, kwargs)
        check_shard_size(data_parallel_shard_size, data_parallel)
        self._experts = StrategyExperts(expert_parallel_size, expert_capacity_factor)  # checks them
        self.pipeline_parallel_size = pipeline_parallel_size
        self.pipeline_schedule, self.pipeline_split = pipeline_schedule, pipeline_split
        self.pipeline_microbatches = pipeline_microbatches or pipeline_parallel_size
        self.pipeline_virtual_stages = pipeline_virtual_stages
        check_pipeline_arguments(
            pipeline_parallel_size,
            pipeline_schedule,
            self.pipeline_microbatches,
            pipeline_virtual_stages,
            data_parallel,
        )
        self._pipeline: LightningPipeline | None = None
        super().__init__(
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method, **kwargs
        )
        self.tensor_parallel_size = tensor_parallel_size
        self.context_parallel_size = context_parallel_size
        self.context_parallel_rotation = context_parallel_rotation
        self._plan = plan
        self._verify_plan = verify_plan
        # Under a pipeline the head's logits are gathered whole: its stage may not be this rank's (loss_parallel off).
        self.loss_parallel = loss_parallel and pipeline_parallel_size == 1
        self.compile = compile
        self.overlap = overlap
        self.async_checkpoint = async_checkpoint
        self.trust_checkpoint = trust_checkpoint
        consolidated.check_data_parallel(save_distributed_checkpoint, data_parallel)
        consolidated.check_pipeline_parallel(save_distributed_checkpoint, pipeline_parallel_size)
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self._checkpoint_writer: AsyncCheckpointWriter | None = None
        self.sequence_parallel = sequence_parallel
        self.activation_checkpointing = activation_checkpointing
        self.data_parallel = data_parallel
        self.data_parallel_shard_size = data_parallel_shard_size
        self._mesh: ParallelMesh | None = None  # the mesh and its views (setup_environment)
        self._launch: rendezvous.Rendezvous | None = None  # this launch's store (this round's, under torchrun)
        check_fused_loss(fused_loss, data_parallel)
        self._loss = StrategyLoss(self.loss_parallel, fused_loss if data_parallel != "fsdp" else False, compile)

    @property
    def parallel_dims(self) -> ParallelDims:
        """The job's degrees: these arguments at the world size (validated in `setup_environment`)."""
        return ParallelDims.from_world(
            self.world_size, tp=self.tensor_parallel_size, cp=self.context_parallel_size,
            pp=self.pipeline_parallel_size, ep=self.expert_parallel_size, data_parallel=self.data_parallel,
            virtual_stages=self.pipeline_virtual_stages, dp_shard=self.data_parallel_shard_size,
        )  # fmt: skip

    @property
    def mesh(self) -> ParallelMesh:
        """The job's mesh and its named views (`ParallelDims.build_mesh`)."""
        if self._mesh is None:
            raise RuntimeError("the device mesh exists once the processes are initialised (setup_environment)")
        return self._mesh

    @property
    def device_mesh(self) -> DeviceMesh:
        return self.mesh.root

    @property
    def tensor_parallel_group(self) -> ProcessGroup:
        return self.mesh.tensor_parallel.get_group()

    @property
    def data_parallel_group(self) -> ProcessGroup:
        return self.mesh.data_parallel.get_group()

    @property
    def context_parallel_group(self) -> ProcessGroup:
        return self.mesh.context_parallel.get_group()

    @property
    def replica_group(self) -> ProcessGroup:
        """The data x context parallel ranks: those whose tokens differ, over which DDP (or FSDP2) averages."""
        return self.mesh.replicas.get_group()

    @property
    def pipeline_parallel_group(self) -> ProcessGroup:
        return self.mesh.pipeline_parallel.get_group()

    @property
    def data_parallel_size(self) -> int:
        return self.parallel_dims.dp

    def cross_entropy(
        self, logits: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0
    ) -> torch.Tensor:
        """Mean cross-entropy of `logits` (..., vocab) against `target` (...), whichever way the model's head
        was sharded: with `loss_parallel` each rank holds its slice of the vocabulary and only per-token
        statistics cross ranks (`tp_train.vocab_parallel_cross_entropy`); otherwise `F.cross_entropy`. Logits in
        half precision are reduced in fp32."""
        self._loss.count(target, ignore_index)  # what `batch_loss` weighs this rank's mean by
        if self._pipeline is not None:  # the microbatch's share of the batch's tokens (tp_train.lightning.pipeline)
            self._pipeline.count_tokens(int((target != ignore_index).sum()), target.numel())
        if self.context_parallel_size > 1:  # logits of this rank's share of the tokens; the mean over all of them
            return context_parallel_cross_entropy(
                self._cross_entropy, logits, target, self.lightning_module, ignore_index, label_smoothing
            )
        return self._cross_entropy(logits, target, ignore_index, label_smoothing)

    def batch_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """For logging: the batch's loss from this rank's `loss` (its training or validation step's), as one process
        would compute it on the whole batch: the mean over the data x context parallel ranks (`replica_group`), each
        weighted by the targets `cross_entropy` counted in its step (by 1 where none went through it). The gradients
        are untouched. Under a pipeline, `loss` itself: the pipeline logs the batch's after its last microbatch."""
        if self._pipeline is not None:
            return loss
        weight = self._loss.targets if self._loss.targets is not None else 1.0
        return mean_over_replicas(loss, weight, self.replica_group)

    @property
    def pipeline_duplicates(self) -> frozenset[int]:
        """`id()` of this rank's copies of tied parameters that an earlier pipeline stage holds too (none without a
        pipeline): counted once over the stages, on the first."""
        return self._pipeline.duplicate_parameters() if self._pipeline is not None else frozenset()

    def _cross_entropy(self, logits, target, ignore_index, label_smoothing) -> torch.Tensor:
        group = self.tensor_parallel_group if self.loss_parallel else None
        return self._loss(self.lightning_module, group, logits, target, ignore_index, label_smoothing)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # the head and the loss fused, where they may be; the tokens dropped over the experts' capacity logged
        with self._experts.counting_drops(self.lightning_module):
            return self._loss.step(self.lightning_module, partial(super().training_step, *args, **kwargs))

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._loss.step(self.lightning_module, partial(super().validation_step, *args, **kwargs))

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        data_parallel = self.mesh.data_parallel
        return {"num_replicas": data_parallel.size(), "rank": data_parallel.get_local_rank()}

    @override
    def setup_environment(self) -> None:
        dims = self.parallel_dims
        dims.validate("devices", self.num_nodes)
        super().setup_environment()
        # every group of the mesh times out like the world group (torch gives its sub-groups a 30-minute default)
        self._mesh = dims.build_mesh(
            self.root_device.type, backend_with_timeout(self._get_process_group_backend(), self._timeout)
        )
        # DDP (or FSDP2) averages gradients over data x context parallel ranks, which hold the same parameters.
        self._ddp_kwargs["process_group"] = self.replica_group
        self._experts.setup_groups(self._mesh)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self.device_mesh

    @property
    def expert_parallel_size(self) -> int:
        return self._experts.size

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        self._experts.after_backward()

    @override
    def setup_distributed(self) -> None:
        # Lightning's, with the store made here: under torchrun, one scoped to this restart round (see
        # tp_train.lightning.rendezvous), which the process group and device mesh then use.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id,
            store=self.launch.store,
        )  # fmt: skip

    def rank_zero_decides(self, decide: Callable[[], Any]) -> Any:
        """`decide()` taken once for the whole job, on global rank 0, and returned on every rank (a JSON value),
        e.g. which checkpoint to resume: through the launch's store before the process group exists
        (`tp_train.lightning.rendezvous.Rendezvous.rank_zero_decides`), by broadcast once it does."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return first_rank_decides(decide)
        return self.launch.rank_zero_decides(decide)

    @property
    def launch(self) -> rendezvous.Rendezvous:
        """This launch's rendezvous: its store, shared by every rank (`tp_train.lightning.hang` beats through it)."""
        if self._launch is None:
            self._launch = rendezvous.Rendezvous(self.cluster_environment, self._timeout or default_pg_timeout)
        return self._launch

    @override
    def _configure_launcher(self) -> None:
        super()._configure_launcher()
        if isinstance(self._launcher, _MultiProcessingLauncher):
            self._launcher = ShardedMultiProcessingLauncher(self, start_method=self._start_method)
        else:
            self._launcher = HydraJobLauncher(self.cluster_environment, self.num_processes, self.num_nodes,
                                              timeout=self._timeout or default_pg_timeout)  # fmt: skip

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
        if not any(t.is_meta for t in self.lightning_module.parameters()):
            self.model_to_device()  # shard on the device: the collectives below run on it
        split = None
        if self.pipeline_parallel_size > 1 and self._pipeline is None:  # decided on the model as written
            split = decide_split(self.lightning_module, self.parallel_dims.stages, self.pipeline_split)
        self._shard(self.lightning_module)
        if split is not None:  # cut the model: this rank's stage only, data-parallel over its replicas
            fsdp = self.data_parallel == "fsdp"
            self._pipeline = LightningPipeline(
                self.lightning_module, self.pipeline_parallel_group, self.pipeline_schedule,
                self.pipeline_microbatches, self.root_device, split,
                replicas=self.replica_group, average_gradients=not fsdp,
                wrap=self._fully_shard_stage if fsdp else None, apart=self._experts.held,
            )  # fmt: skip
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.data_parallel == "fsdp" and self._pipeline is None:
            self._fully_shard(self.lightning_module)
        self._tell_precision_plugin(self.lightning_module)
        fitting = trainer.state.fn == TrainerFn.FITTING
        replicated = self.parallel_dims.dp_cp > 1 and self.data_parallel == "ddp"
        if fitting and replicated and self._pipeline is None:  # a pipeline averages its stages' gradients itself
            self.configure_ddp()
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

    def _shard(self, root: torch.nn.Module) -> None:
        """Shards every planned module of `root` once (setup runs again for validate/test after fit)."""
        if not getattr(root, "_tp_sharded", False):
            targets = [("", root)] if self._plan is not None else modules_with_plans(root)
            # No plan anywhere: the auto-planner plans the LightningModule through its forward (ids -> logits).
            targets = targets or [("", root)]
            if not any(t.is_meta for t in root.parameters()):
                # Ranks may have built different random weights: shard the same ones everywhere, as DDP would.
                _sync_module_states(root)
            else:  # built on meta: each rank draws the whole weights it keeps from rank 0's stream, as one process
                # would, though the ranks may come here on different ones (a prepare_data drew on rank 0 only)
                sync_default_generator(torch.distributed.group.WORLD, self.root_device)
            examples = example_inputs(self.lightning_module.trainer, root, targets, self.tensor_parallel_group)
            separator = getattr(self.lightning_module.trainer.datamodule, "document_separator", None)  # document_mask
            cp_group = self.context_parallel_group if self.context_parallel_size > 1 or separator is not None else None
            for name, module in targets:
                parallelize(
                    module,
                    self.tensor_parallel_group,
                    plan=self._plan,
                    device=self.root_device,
                    verify=self._verify_plan,
                    loss_parallel="auto" if self.loss_parallel else False,
                    compile=self.compile,
                    overlap=self.overlap,
                    sequence_parallel=self.sequence_parallel,
                    activation_checkpointing=self.activation_checkpointing,
                    example_input=examples.get(name),
                    cp_group=cp_group,
                    cp_options={"rotation": self.context_parallel_rotation, "document_separator": separator},
                    experts_whole=self._experts.size > 1,
                )
            if self.loss_parallel and not attached(root, "tp_vocab_size"):
                self.loss_parallel = self._loss.loss_parallel = False
                rank_zero_info(
                    "loss_parallel off: no LM head is planned 'colwise_gather_output' (the model's "
                    "get_output_embeddings() stays whole under its plan); the loss takes the whole logits"
                )
            # Whatever else was built on the meta device (outside the planned models) is replicated.
            if any(t.is_meta for t in root.parameters()) or any(t.is_meta for t in root.buffers()):
                materialize_remaining(root, self.root_device)
            data_parallel_rank = self.mesh.data_parallel.get_local_rank()
            for rng in attached(root, "tp_rng"):
                rng.separate_data_parallel_replicas(data_parallel_rank)
            self._experts.shard(root, self.tensor_parallel_size)  # whole experts per rank, split over the ep group
            root._tp_sharded = True

    def _fully_shard(self, root: pl.LightningModule) -> None:
        """FSDP2 over the data-parallel axis, once: per block, per planned model, then the LightningModule, whose
        step methods gather the parameters as its forward would."""
        if isinstance(root, FSDPModule):
            return
        refuse_replicated_shards(root, self.tensor_parallel_size)
        models = [module for _, module in modules_with_plans(root)] if self._plan is None else [root]
        fully_shard_data_parallel(
            root,
            models or [root],
            self.mesh.fully_sharded,
            mp_policy=fsdp_mixed_precision_policy(self.precision_plugin),
            extra_methods=("training_step", "validation_step", "test_step", "predict_step"),
            ignored_params=self._experts.held,
        )

    def _fully_shard_stage(self, stage: torch.nn.Module) -> torch.nn.Module:
        """FSDP2 over the data-parallel axis on one pipeline stage's module (its blocks, then the stage), as
        torchtitan does; torch's `PipelineStage` reduce-scatters its gradients after the last microbatch."""
        refuse_replicated_shards(stage, self.tensor_parallel_size)
        policy = fsdp_mixed_precision_policy(self.precision_plugin)
        held, mesh = self._experts.held, self.mesh.fully_sharded
        fully_shard_data_parallel(stage, list(stage.children()), mesh, mp_policy=policy, ignored_params=held)
        return stage

    def _tell_precision_plugin(self, root: torch.nn.Module) -> None:
        """The clipping norm's group and the tensor-parallel shards (by id: FSDP2 replaces the parameters)."""
        plugin = self.precision_plugin
        plugin.tensor_parallel_group = self.tensor_parallel_group
        if self._pipeline is not None:  # the norm over every stage, each tied parameter once
            plugin.pipeline_parallel_group = self.pipeline_parallel_group
            plugin.pipeline_duplicates = self._pipeline.duplicate_parameters()
        plugin.sharded_parameters = {id(param): spec for _, param, spec in named_sharded_parameters(root)}
        plugin.experts = self._experts.clipping()

    @contextmanager
    @override
    def block_backward_sync(self):
        """No data-parallel gradient reduction while Lightning accumulates micro-batches (DDP's `no_sync`, FSDP2's
        `set_requires_gradient_sync(False)`); the last micro-batch's backward reduces the sum."""
        root = self.lightning_module
        if self._pipeline is not None:  # its backward averages over the replicas only outside this block
            self._pipeline.synchronize = False
            try:
                with self._experts.blocking():
                    yield
            finally:
                self._pipeline.synchronize = True
            return
        if not isinstance(root, FSDPModule):
            with super().block_backward_sync(), self._experts.blocking():
                yield
            return
        root.set_requires_gradient_sync(False)
        try:
            with self._experts.blocking():
                yield
        finally:
            root.set_requires_gradient_sync(True)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, start_method in ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn")):
            if name not in strategy_registry:
                strategy_registry.register(
                    name, cls, description=f"{cls.__name__} ({start_method})", start_method=start_method
                )
