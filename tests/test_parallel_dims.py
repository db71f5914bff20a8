"""`ParallelDims`, the one owner of the degrees: its refusals (one line each, the values named, what would work), the
devices a config's degrees take, and the mesh's views, read with torch's fake process group in this one process at
16 and 8 ranks. The expected ranks are written by hand from the layout rule (pipeline outermost, then data
replicate, data shard, context, tensor innermost; experts: runs of ep consecutive data x context ranks), which is
the mesh the strategy built before ParallelDims (pipeline, data, context, tensor)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.testing._internal.distributed.fake_pg import FakeStore

from tp_train import ParallelDims
from tp_train.app.resolvers import register_resolvers
from tp_train.lightning.metrics import parallel_dims
from tp_train.parallel.dims import MESH_AXES

ROOT = Path(__file__).resolve().parents[1]

REFUSALS = {
    "tp_not_dividing": (ParallelDims.from_world(6, tp=4), {},
                        "devices=6 x num_nodes=1 = 6 ranks is not a multiple of tp=4 x cp=1 x pp=1; use devices in "
                        "[4, 8, 12, 16]"),
    "pp_cp_not_dividing": (ParallelDims.from_world(12, tp=2, cp=2, pp=2), {"devices_key": "trainer.devices"},
                           "trainer.devices=12 x trainer.num_nodes=1 = 12 ranks is not a multiple of tp=2 x cp=2 x "
                           "pp=2; use trainer.devices in [8, 16, 24, 32]"),
    "over_nodes": (ParallelDims.from_world(6, tp=4), {"devices_key": "trainer.devices", "num_nodes": 2},
                   "trainer.devices=3 x trainer.num_nodes=2 = 6 ranks is not a multiple of tp=4 x cp=1 x pp=1; use "
                   "trainer.devices in [2, 4, 6, 8]"),
    "ep_not_dividing_replicas": (ParallelDims.from_world(6, tp=2, ep=2), {},
                                 "ep=2 does not divide dp x cp = 3 (devices=6 x num_nodes=1 over tp=2 x pp=1); expert "
                                 "parallelism splits the experts among those ranks, it adds none: use devices in "
                                 "[4, 8, 12, 16]"),
    "ep_with_cp": (ParallelDims.from_world(3, cp=3, ep=2), {},
                   "ep=2 does not divide dp x cp = 3 (devices=3 x num_nodes=1 over tp=1 x pp=1); expert parallelism "
                   "splits the experts among those ranks, it adds none: use devices in [6, 12, 18, 24]"),
    "dp_shard_not_dividing": (ParallelDims.from_world(12, tp=2, data_parallel="fsdp", dp_shard=4), {},
                              "dp_shard=4 does not divide the 6 data-parallel ranks (dp per node x nodes); use "
                              "dp_shard in [2, 3, 6]"),
    "shard_group_over_nodes": (ParallelDims.from_world(16, cp=2, data_parallel="fsdp", dp_shard=4), {"num_nodes": 4},
                               "dp_shard=4: a shard group of dp_shard x cp=2 x tp=1 = 8 ranks would span nodes (4 "
                               "ranks each); use dp_shard in [2]"),
    "degrees_not_filling_the_world": (ParallelDims(dp_replicate=2, tp=2, world_size=8), {},
                                      "pp=1 x dp_replicate=2 x dp_shard=1 x cp=1 x tp=2 = 4 ranks, not the world size "
                                      "8; use ParallelDims.from_world(8, ...), which derives dp"),
    "tp_zero": (ParallelDims.from_world(8, tp=0), {}, "tp=0 must be a positive integer, e.g. tp=2"),
    "virtual_stages_not_integer": (ParallelDims.from_world(8, pp=2, virtual_stages=1.5), {},
                                   "virtual_stages=1.5 must be a positive integer, e.g. virtual_stages=2"),
    "pp_above_blocks": (ParallelDims.from_world(4, pp=4), {"blocks": (3, "GPT's 'blocks'")},
                        "pipeline parallelism: 4 stages (pipeline_parallel_size x virtual stages) but GPT's 'blocks' "
                        "has 3 blocks; use at most 3 stages"),
    "virtual_stages_not_dividing_blocks": (ParallelDims.from_world(2, pp=2, virtual_stages=2),
                                           {"blocks": (6, "GPT's 'blocks'")},
                                           "pipeline parallelism: GPT's 'blocks' has 6 blocks, which pp=2 x virtual "
                                           "stages=2 = 4 stages do not split evenly; use virtual stages in [3]"),
    "virtual_stages_not_dividing_any_way": (ParallelDims.from_world(2, pp=2, virtual_stages=2),
                                            {"blocks": (5, "the model")},
                                            "pipeline parallelism: the model has 5 blocks, which pp=2 x virtual "
                                            "stages=2 = 4 stages do not split evenly; use pipeline_virtual_stages=1 "
                                            "(one stage per rank)"),
}  # fmt: skip


def test_the_blocks_are_checked_only_where_given_and_one_stage_per_rank_may_split_unevenly():
    ParallelDims.from_world(2, pp=2, virtual_stages=2).validate()
    ParallelDims.from_world(2, pp=2).validate(blocks=(3, "GPT's 'blocks'"))  # 2 + 1: uneven, one stage per rank
    ParallelDims.from_world(2, pp=2, virtual_stages=2).validate(blocks=(8, "GPT's 'blocks'"))


@pytest.mark.parametrize("case", list(REFUSALS))
def test_validate_refuses_in_one_line_naming_what_would_work(case):
    dims, where, expected = REFUSALS[case]
    with pytest.raises(ValueError) as refused:
        dims.validate(**where)
    message = str(refused.value)
    assert message == expected and "\n" not in message


def test_an_unknown_data_parallel_mode_is_refused():
    with pytest.raises(ValueError, match=r"^data_parallel='zero': use one of 'ddp', 'fsdp'$"):
        ParallelDims.from_world(8, data_parallel="zero")


@pytest.mark.parametrize(
    "mode, dp_shard, expected",
    [
        ("ddp", 2, "dp_shard=2 with data_parallel=ddp: HSDP needs data_parallel=fsdp; use data_parallel=fsdp, or "
                   "dp_shard=null"),
        ("fsdp", 1, "dp_shard=1 with data_parallel=fsdp shards nothing (every data-parallel rank a whole copy); use "
                    "data_parallel=ddp, or dp_shard of 2 or more"),
    ],
)  # fmt: skip
def test_a_shard_group_size_without_sharding_is_refused(mode, dp_shard, expected):
    with pytest.raises(ValueError) as refused:
        ParallelDims.from_world(8, data_parallel=mode, dp_shard=dp_shard)
    assert str(refused.value) == expected


@pytest.mark.parametrize("dp_shard, replicate, name", [(2, 4, "hsdp"), (8, 1, "fsdp"), (None, 1, "fsdp")])
def test_dp_shard_leaves_the_replicate_size(dp_shard, replicate, name):
    dims = ParallelDims.from_world(32, tp=2, cp=2, data_parallel="fsdp", dp_shard=dp_shard)
    dims.validate(num_nodes=2)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.data_parallel) == (replicate, 8 // replicate, 8, name)


@pytest.mark.parametrize(
    "mode, replicate, shard, name", [("ddp", 2, 1, "ddp"), ("fsdp", 1, 2, "fsdp")], ids=["ddp", "fsdp"]
)
def test_the_world_leaves_the_data_parallel_size(mode, replicate, shard, name):
    dims = ParallelDims.from_world(16, tp=2, cp=2, pp=2, ep=4, data_parallel=mode, virtual_stages=2)
    dims.validate()
    assert (dims.dp_replicate, dims.dp_shard, dims.dp, dims.dp_cp) == (replicate, shard, 2, 4)
    assert (dims.model_parallel, dims.expert_replicas, dims.stages, dims.data_parallel) == (8, 1, 4, name)


@pytest.mark.parametrize(
    "degrees, devices",
    [
        ({}, 1),
        ({"dp": 2, "tp": 2}, 4),
        ({"dp": 1, "ep": 2}, 2),  # ep regroups dp x cp: raised to a multiple of it
        ({"dp": 3, "ep": 2}, 6),
        ({"dp": 2, "tp": 2, "cp": 2, "pp": 2, "ep": 8}, 32),
        ({"dp": 2, "tp": 2, "pp": 2, "ep": 2}, 8),
    ],
)
def test_the_devices_a_config_takes(degrees, devices):
    assert ParallelDims.devices_for(**degrees) == devices
    # conf/trainer/default.yaml's default, through its resolver
    register_resolvers()
    trainer = OmegaConf.load(ROOT / "conf" / "trainer" / "default.yaml")
    config = OmegaConf.create({"dp": 1, "tp": 1, "cp": 1, "pp": 1, "ep": 1, **degrees, "trainer": trainer})
    assert config.trainer.devices == devices
    dims = ParallelDims.from_world(devices, **{key: value for key, value in degrees.items() if key != "dp"})
    dims.validate()  # the devices it takes always fit


@pytest.fixture
def fake_world(request):
    """A fake process group of `world_size` ranks, this process being `rank`: groups are made, none talks."""
    world_size, rank = request.param
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    yield
    dist.destroy_process_group()


def _ranks(mesh) -> list[int]:
    return mesh.mesh.flatten().tolist()


# (world size, this rank), degrees, then each view's ranks holding this rank.
MESHES = {
    "pp2_dp2_tp2": ((8, 5), {"pp": 2, "tp": 2}, {
        "tensor_parallel": [4, 5], "context_parallel": [5], "pipeline_parallel": [1, 5], "data_replicate": [5, 7],
        "data_shard": [5], "data_parallel": [5, 7], "replicas": [5, 7],
    }),
    "cp2_tp2_dp2_ep2": ((8, 6), {"cp": 2, "tp": 2, "ep": 2}, {
        "tensor_parallel": [6, 7], "context_parallel": [4, 6], "pipeline_parallel": [6], "data_replicate": [2, 6],
        "data_shard": [6], "data_parallel": [2, 6], "replicas": [0, 2, 4, 6], "expert_parallel": [4, 6],
        "expert_replicas": [2, 6],
    }),
    "pp2_fsdp2_cp2_tp2_ep4": ((16, 11), {"pp": 2, "cp": 2, "tp": 2, "ep": 4, "data_parallel": "fsdp"}, {
        "tensor_parallel": [10, 11], "context_parallel": [9, 11], "pipeline_parallel": [3, 11],
        "data_replicate": [11], "data_shard": [11, 15], "data_parallel": [11, 15], "replicas": [9, 11, 13, 15],
        "expert_parallel": [9, 11, 13, 15], "expert_replicas": [11],
    }),
    # HSDP: FSDP2's mesh is (replicate, shard x context); its rows are the shard groups, its columns the copies
    "hsdp_rep2_shard2_cp2_tp2": ((16, 13), {"cp": 2, "tp": 2, "data_parallel": "fsdp", "dp_shard": 2}, {
        "data_replicate": [5, 13], "data_shard": [9, 13], "data_parallel": [1, 5, 9, 13], "replicas": [1, 3, 5, 7, 9,
        11, 13, 15], "hybrid_shard": [1, 3, 5, 7, 9, 11, 13, 15], "fully_sharded": [1, 3, 5, 7, 9, 11, 13, 15],
    }),
    "dp8_tp2_ep4": ((16, 3), {"tp": 2, "ep": 4}, {
        "tensor_parallel": [2, 3], "pipeline_parallel": [3], "data_parallel": [1, 3, 5, 7, 9, 11, 13, 15],
        "replicas": [1, 3, 5, 7, 9, 11, 13, 15], "expert_parallel": [1, 3, 5, 7], "expert_replicas": [3, 11],
    }),
}  # fmt: skip


@pytest.mark.parametrize(
    "fake_world, case", [(MESHES[case][0], case) for case in MESHES], ids=list(MESHES), indirect=["fake_world"]
)
def test_the_mesh_views_hold_the_ranks_the_layout_gives(fake_world, case):
    (world_size, _), degrees, expected = MESHES[case]
    dims = ParallelDims.from_world(world_size, **degrees)
    dims.validate()
    mesh = dims.build_mesh("cpu")
    assert mesh.root.mesh_dim_names == MESH_AXES
    assert tuple(mesh.root.mesh.shape) == (dims.pp, dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp)
    views = {name: _ranks(getattr(mesh, name)) for name in expected}
    assert views == expected
    if dims.data_parallel == "hsdp":  # (replicate, shard x context), each row a shard group of this rank's copy
        assert mesh.hybrid_shard.mesh_dim_names == ("data_parallel_replicate", "data_context_shard")
        assert mesh.hybrid_shard.mesh.tolist() == [[1, 3, 5, 7], [9, 11, 13, 15]]
        assert _ranks(mesh.hybrid_shard["data_context_shard"]) == [9, 11, 13, 15]
    else:
        assert mesh.hybrid_shard is None and mesh.fully_sharded is mesh.replicas
    if dims.ep == 1:
        with pytest.raises(ValueError, match="exists with expert parallelism only; use ep > 1"):
            _ = mesh.expert_parallel


@pytest.mark.parametrize(
    "strategy, world_size, dp, tp",
    [
        (SimpleNamespace(parallel_dims=ParallelDims.from_world(16, tp=2, cp=2, pp=2)), 16, 2, 2),
        (SimpleNamespace(), 4, 4, 1),  # Lightning's own strategies: every rank its own batches
    ],
    ids=["tensor_parallel", "ddp"],
)
def test_metrics_count_data_parallel_ranks_from_the_degrees(strategy, world_size, dp, tp):
    """`TrainingMetrics` counted world_size // tp data-parallel ranks, which cp and pp are not (16 ranks at tp=cp=pp=2
    are dp=2, not 8)."""
    dims = parallel_dims(SimpleNamespace(strategy=strategy, world_size=world_size))
    assert (dims.dp, dims.tp) == (dp, tp)
