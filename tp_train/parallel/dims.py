"""`ParallelDims`: every parallel degree of a job in one record, the one place they are checked against each other and
multiplied, and the one `DeviceMesh` (with every named view the code uses) built from them.

The layout, outermost to innermost (a rank's coordinates in this order, the last varying fastest):

    pipeline_parallel x data_parallel_replicate x data_parallel_shard x context_parallel x tensor_parallel

Pipeline stages outermost: only activations cross them, once per microbatch, so they may span nodes; tensor
parallelism innermost keeps its every-layer collectives within a node. Expert parallelism adds no ranks: it regroups
the data x context parallel ranks (the replicas) into runs of `ep` consecutive ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tp_train.parallel.mesh import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    DATA_PARALLEL_MODES,
    DATA_REPLICATE,
    DATA_SHARD,
    EXPERT_PARALLEL,
    EXPERT_REPLICAS,
    PIPELINE_PARALLEL,
    REPLICAS,
    SHARD_GROUP,
    TENSOR_PARALLEL,
)

# The root mesh's axes, outermost first (see the module's docstring for why this order).
MESH_AXES = (PIPELINE_PARALLEL, DATA_REPLICATE, DATA_SHARD, CONTEXT_PARALLEL, TENSOR_PARALLEL)
SUGGESTIONS = 4  # how many fitting device counts an error lists


def check_shard_mode(
    dp_shard: int | None,
    data_parallel: str,
    shard_key: str = "dp_shard",
    mode_key: str = "data_parallel",
    unset: str = "null",
) -> None:
    """Raises ValueError for a data-parallel shard size (HSDP) given without FSDP2, in the caller's names for the
    two settings (the config's keys, or the strategy's arguments) and for leaving the size unset."""
    if dp_shard is not None and data_parallel != "fsdp":
        raise ValueError(
            f"{shard_key}={dp_shard} with {mode_key}={data_parallel}: HSDP needs {mode_key}=fsdp; use "
            f"{mode_key}=fsdp, or {shard_key}={unset}"
        )


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of one job, which `world_size` ranks must fill: `pp x dp_replicate x dp_shard x cp x tp`.

    Build it with `from_world` (dp derived from the world size) and call `validate` before using it; its
    properties are the only products of degrees in the package."""

    dp_replicate: int = 1  # data-parallel ranks holding whole copies of a shard (DDP; HSDP's outer axis)
    dp_shard: int = 1  # data-parallel ranks splitting a shard's parameters and optimizer states (FSDP2)
    cp: int = 1  # context parallelism: each rank holds a share of every sequence
    tp: int = 1  # tensor parallelism: each rank holds a slice of every layer
    pp: int = 1  # pipeline stages (rank groups), each holding `virtual_stages` stages of the model
    ep: int = 1  # expert parallelism: ranks among dp x cp splitting each MoE layer's experts (adds no ranks)
    virtual_stages: int = 1  # model stages per pipeline rank (interleaved schedules)
    world_size: int = 1  # the ranks the degrees must fill

    @classmethod
    def from_world(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        pp: int = 1,
        ep: int = 1,
        data_parallel: str = "ddp",
        virtual_stages: int = 1,
        dp_shard: int | None = None,
    ) -> ParallelDims:
        """The degrees `world_size` ranks hold at these model-parallel sizes: the data-parallel size is what they
        leave, replicated ("ddp") or sharded ("fsdp"): over all of it (`dp_shard` None), or over groups of `dp_shard`
        ranks, replicated across the groups (HSDP). Not yet validated (a size that does not divide is kept as given
        for `validate` to name)."""
        if data_parallel not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel={data_parallel!r}: use one of {', '.join(map(repr, DATA_PARALLEL_MODES))}")
        check_shard_mode(dp_shard, data_parallel)
        if dp_shard == 1:  # validate cannot tell it from DDP's degrees, which FSDP2 would then shard over all of dp
            raise ValueError(
                "dp_shard=1 with data_parallel=fsdp shards nothing (every data-parallel rank a whole copy); use "
                "data_parallel=ddp, or dp_shard of 2 or more"
            )
        fills = world_size // (tp * cp * pp) if _positive(tp, cp, pp, world_size) else 0  # validate names a rest
        replicate, shard = (fills, 1) if data_parallel == "ddp" else (1, fills)
        if dp_shard is not None:  # a dp_shard that does not divide leaves a rest, which validate names
            replicate, shard = (fills // dp_shard if _positive(dp_shard) else 0), dp_shard
        return cls(replicate, shard, cp, tp, pp, ep, virtual_stages, world_size)

    @staticmethod
    def ranks_of(devices: int, num_nodes: int = 1) -> int:
        """The ranks a job of `devices` per node on `num_nodes` nodes starts (its world size)."""
        return devices * num_nodes

    @staticmethod
    def ranks_per_node(world_size: int, num_nodes: int = 1) -> int:
        """The ranks each node holds of a world split evenly over `num_nodes` (`trainer.devices`)."""
        return world_size // num_nodes

    @staticmethod
    def devices_for(dp: int = 1, tp: int = 1, cp: int = 1, pp: int = 1, ep: int = 1) -> int:
        """The ranks a config's degrees take: tp x pp x (dp x cp raised to a multiple of ep, which regroups those
        ranks and adds none of its own). conf/trainer/default.yaml's `devices` default."""
        return tp * pp * math.lcm(dp * cp, ep)

    def dp_per_node(self, num_nodes: int) -> int | None:
        """The data-parallel size on each of `num_nodes` nodes (the config's `dp`, which is per node); None where the
        nodes cannot hold the same number."""
        return None if self.dp % num_nodes else self.dp // num_nodes

    # What the degrees make: the only products of degrees in tp_train.
    @property
    def dp(self) -> int:
        """Data-parallel ranks in all: replicate x shard (each a different batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp(self) -> int:
        """Ranks whose tokens differ, holding the same parameters: data x context parallel. Gradients and the
        logged loss are averaged over them."""
        return self.dp * self.cp

    @property
    def shard_ranks(self) -> int:
        """Ranks FSDP2 splits each parameter over: a shard group's data x context ranks (all of dp x cp for FSDP)."""
        return self.dp_shard * self.cp

    @property
    def model_parallel(self) -> int:
        """Ranks one data-parallel replica spans: tp x cp x pp."""
        return self.tp * self.cp * self.pp

    @property
    def expert_replicas(self) -> int:
        """Ranks holding the same experts (dp x cp / ep), over which the experts' gradients are averaged."""
        return self.dp_cp // self.ep

    @property
    def stages(self) -> int:
        """The model's pipeline stages in all: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    def pipeline_rank(self, rank: int) -> int:
        """`rank`'s place in its pipeline: its coordinate on the mesh's outermost axis."""
        return rank // (self.world_size // self.pp)

    @property
    def data_parallel(self) -> str:
        """How the data-parallel ranks hold a shard: "ddp" (replicated; also at dp=1), "fsdp" (sharded) or "hsdp"
        (both). At dp=1 the strategy's own `data_parallel` says whether FSDP2 shards over the context ranks."""
        if self.dp_shard > 1:
            return "hsdp" if self.dp_replicate > 1 else "fsdp"
        return "ddp"

    def validate(self, devices_key: str = "devices", num_nodes: int = 1, blocks: tuple[int, str] | None = None) -> None:
        """Raises ValueError, in one line naming the values and what would work, for degrees that do not fit together
        or the world size. `devices_key` names where the devices per node come from (e.g. "trainer.devices"), and
        `num_nodes` how many nodes share the world, for the error to say which device counts would fit. With
        `blocks` (the model's count of repeated blocks and where they are, e.g. (2, "GPT's 'blocks'")), the
        pipeline's stages are checked against them too (`check_blocks`)."""
        for name in ("tp", "cp", "pp", "ep", "virtual_stages", "world_size"):
            value = getattr(self, name)
            if not _positive(value):
                raise ValueError(f"{name}={value!r} must be a positive integer, e.g. {name}=2")
        devices = _devices(devices_key, num_nodes, self.world_size)
        if self.world_size % self.model_parallel:
            raise ValueError(
                f"{devices} = {self.world_size} ranks is not a multiple of tp={self.tp} x cp={self.cp} x "
                f"pp={self.pp}; use {devices_key} in {_fitting(self.model_parallel, num_nodes)}"
            )
        if not _positive(self.dp_shard):
            raise ValueError(f"dp_shard={self.dp_shard!r} must be a positive integer, e.g. dp_shard=2")
        self._check_shard_groups(num_nodes)
        if not _positive(self.dp_replicate):
            raise ValueError(f"dp_replicate={self.dp_replicate!r} must be a positive integer, e.g. dp_replicate=1")
        filled = self.pp * self.dp * self.cp * self.tp
        if filled != self.world_size:
            raise ValueError(
                f"pp={self.pp} x dp_replicate={self.dp_replicate} x dp_shard={self.dp_shard} x cp={self.cp} x "
                f"tp={self.tp} = {filled} ranks, not the world size {self.world_size}; use "
                f"ParallelDims.from_world({self.world_size}, ...), which derives dp"
            )
        if self.dp_cp % self.ep:
            fits = math.lcm(self.ep, self.cp) * self.tp * self.pp  # the fewest ranks whose replicas ep divides
            raise ValueError(
                f"ep={self.ep} does not divide dp x cp = {self.dp_cp} ({devices} over tp={self.tp} x "
                f"pp={self.pp}); expert parallelism splits the experts among those ranks, it adds none: use "
                f"{devices_key} in {_fitting(fits, num_nodes)}"
            )
        if blocks is not None:
            self.check_blocks(*blocks)

    def check_blocks(self, count: int, where: str = "the model") -> None:
        """The pipeline's stages (pp x virtual_stages) against the model's `count` repeated blocks (`where`: which
        model and list, for the message): at most one stage per block, and with virtual stages the same number of
        blocks in every stage (the interleaved schedules' stages take turns on a rank)."""
        if self.stages > count:
            raise ValueError(
                f"pipeline parallelism: {self.stages} stages (pipeline_parallel_size x virtual stages) but {where} "
                f"has {count} blocks; use at most {count} stages"
            )
        if self.virtual_stages > 1 and count % self.stages:
            fits = [v for v in range(2, count // self.pp + 1) if count % (self.pp * v) == 0]
            use = f"virtual stages in {fits}" if fits else "pipeline_virtual_stages=1 (one stage per rank)"
            raise ValueError(
                f"pipeline parallelism: {where} has {count} blocks, which pp={self.pp} x virtual stages="
                f"{self.virtual_stages} = {self.stages} stages do not split evenly; use {use}"
            )

    def _check_shard_groups(self, num_nodes: int) -> None:
        """HSDP's shard groups (`dp_shard` data-parallel ranks, each with its cp x tp ranks: consecutive ranks) must
        divide the data-parallel ranks and stay within a node, where FSDP2's every-block all-gathers run."""
        dp = self.world_size // self.model_parallel
        if self.dp_shard == 1 or self.dp_shard == dp:
            return  # DDP, or FSDP2 over all of dp (which may span nodes)
        per_node = self.world_size // num_nodes if self.world_size % num_nodes == 0 else self.world_size
        fits = [k for k in range(2, dp + 1) if dp % k == 0 and per_node % (k * self.cp * self.tp) == 0]
        if dp % self.dp_shard:
            raise ValueError(
                f"dp_shard={self.dp_shard} does not divide the {dp} data-parallel ranks (dp per node x nodes); "
                f"use dp_shard in {fits}"
            )
        if per_node % (self.dp_shard * self.cp * self.tp):
            raise ValueError(
                f"dp_shard={self.dp_shard}: a shard group of dp_shard x cp={self.cp} x tp={self.tp} = "
                f"{self.dp_shard * self.cp * self.tp} ranks would span nodes ({per_node} ranks each); use dp_shard "
                f"in {fits}"
            )

    def build_mesh(self, device_type: str, backend: Any = None) -> ParallelMesh:
        """The job's one `DeviceMesh` (axes `MESH_AXES`) and every view the code uses; a collective over the world
        (every rank builds every group). `backend` (a backend name, or a (name, options) pair such as a timeout) is
        given to every axis and view, so none falls back to torch's defaults."""
        override = None if backend is None else dict.fromkeys(MESH_AXES, backend)
        sizes = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        root = init_device_mesh(device_type, sizes, mesh_dim_names=MESH_AXES, backend_override=override)
        # torch 2.13 makes derived views only through these private calls; this is the one file that uses them.
        data_parallel = root[(DATA_REPLICATE, DATA_SHARD)]._flatten(DATA_PARALLEL, backend)
        replicas = root[(DATA_REPLICATE, DATA_SHARD, CONTEXT_PARALLEL)]._flatten(REPLICAS, backend)
        hybrid = None
        if self.dp_replicate > 1 and self.dp_shard > 1:  # HSDP: FSDP2's (replicate, shard) mesh
            names = (DATA_REPLICATE, SHARD_GROUP)
            hybrid_override = None if backend is None else dict.fromkeys(names, backend)
            hybrid = replicas._unflatten(0, (self.dp_replicate, self.shard_ranks), names, hybrid_override)
        experts = None
        if self.ep > 1:  # runs of ep consecutive replicas (context innermost), and the ranks at one place of each run
            names = (EXPERT_REPLICAS, EXPERT_PARALLEL)
            experts_override = None if backend is None else dict.fromkeys(names, backend)
            experts = replicas._unflatten(0, (self.expert_replicas, self.ep), names, experts_override)
        return ParallelMesh(root, data_parallel, replicas, experts, hybrid)


@dataclass(frozen=True)
class ParallelMesh:
    """The job's mesh and its named views, each a 1-D `DeviceMesh` holding this rank (`.get_group()` for its
    process group). Built by `ParallelDims.build_mesh`; ask it for a view rather than slicing names."""

    root: DeviceMesh  # (pipeline, data replicate, data shard, context, tensor): MESH_AXES
    data_parallel: DeviceMesh  # replicate x shard flattened: the ranks that each take a different batch (sampler)
    replicas: DeviceMesh  # data x context flattened: same parameters, different tokens; DDP / FSDP2 average over it
    experts: DeviceMesh | None = None  # (expert replicas, expert parallel) over `replicas`; None at ep=1
    # HSDP's (data replicate, data shard x context) over `replicas`; None unless dp_replicate and dp_shard are over 1
    hybrid_shard: DeviceMesh | None = None

    @property
    def fully_sharded(self) -> DeviceMesh:
        """FSDP2's mesh: `replicas` (1-D: each shard split over every data x context rank), or under HSDP the 2-D
        (replicate, shard) `hybrid_shard` (split within a shard group, replicated across the groups)."""
        return self.replicas if self.hybrid_shard is None else self.hybrid_shard

    @property
    def tensor_parallel(self) -> DeviceMesh:
        """Ranks holding slices of the same layers; their collectives run in every layer."""
        return self.root[TENSOR_PARALLEL]

    @property
    def context_parallel(self) -> DeviceMesh:
        """Ranks holding shares of the same sequences; attention runs across them."""
        return self.root[CONTEXT_PARALLEL]

    @property
    def pipeline_parallel(self) -> DeviceMesh:
        """Ranks holding the successive stages of one model copy; activations pass along them."""
        return self.root[PIPELINE_PARALLEL]

    @property
    def data_replicate(self) -> DeviceMesh:
        """Data-parallel ranks holding whole copies of the same shard (DDP's axis, HSDP's outer one)."""
        return self.root[DATA_REPLICATE]

    @property
    def data_shard(self) -> DeviceMesh:
        """Data-parallel ranks splitting one shard's parameters between them (FSDP2's axis, HSDP's inner one)."""
        return self.root[DATA_SHARD]

    @property
    def expert_parallel(self) -> DeviceMesh:
        """A run of ep consecutive replicas: they split each MoE layer's experts, and tokens travel among them."""
        return self._experts(EXPERT_PARALLEL)

    @property
    def expert_replicas(self) -> DeviceMesh:
        """The replicas at one place of every run: they hold the same experts, whose gradients they average."""
        return self._experts(EXPERT_REPLICAS)

    def roles(self) -> dict[str, str]:
        """{process group name: its view's name} for every view of this rank, innermost first (a group two views
        share is named by the first): what a count of collectives files each under (`tp_train.tools.step_counts`)."""
        views = [(TENSOR_PARALLEL, self.tensor_parallel), (CONTEXT_PARALLEL, self.context_parallel)]
        if self.experts is not None:
            views += [(EXPERT_PARALLEL, self.expert_parallel), (EXPERT_REPLICAS, self.expert_replicas)]
        if self.hybrid_shard is not None:
            views += [
                (SHARD_GROUP, self.hybrid_shard[SHARD_GROUP]),
                (DATA_REPLICATE, self.hybrid_shard[DATA_REPLICATE]),
            ]
        views += [
            (REPLICAS, self.replicas),
            (DATA_PARALLEL, self.data_parallel),
            (PIPELINE_PARALLEL, self.pipeline_parallel),
        ]
        roles: dict[str, str] = {}
        for name, view in views:
            roles.setdefault(view.get_group().group_name, name)
        return roles

    def _experts(self, name: str) -> DeviceMesh:
        if self.experts is None:
            raise ValueError(f"the {name} view exists with expert parallelism only; use ep > 1")
        return self.experts[name]


def _positive(*values: Any) -> bool:
    return all(isinstance(value, int) and not isinstance(value, bool) and value >= 1 for value in values)


def _devices(devices_key: str, num_nodes: int, world_size: int) -> str:
    """How the world was made, as the user wrote it: `trainer.devices=3 x trainer.num_nodes=1`."""
    nodes_key = devices_key.removesuffix("devices") + "num_nodes"
    per_node = world_size // num_nodes if world_size % num_nodes == 0 else f"{world_size}/{num_nodes}"
    return f"{devices_key}={per_node} x {nodes_key}={num_nodes}"


def _fitting(ranks: int, num_nodes: int) -> list[int]:
    """The first device counts per node whose world (x `num_nodes`) is a multiple of `ranks`."""
    step = ranks // math.gcd(ranks, num_nodes)
    return [step * n for n in range(1, SUGGESTIONS + 1)]
