"""The order test files start in under `make test` (pytest-xdist, `--dist loadfile`: each worker takes whole files),
and the tests `make test-fast` (`-m "not slow"`) leaves out beside those marked `@pytest.mark.slow` in their files.

xdist's default hands out files with the most tests first, which leaves the files of one or a few long tests
(a `train.py` run, an inductor compile) to the end, where one worker runs them alone while the other sits idle.
The files that take longest start first instead (in this order, by their measured times); every other
file follows in collection order and fills in around them.

Every pytest worker, and every process a test starts, computes on one thread: with the workers on two cores (and
their tests' ranks beside them), a second OpenMP thread per process only spins waiting for a core. Measured on the
2-core machine at a load of 3-6: `infer_plan` on SeamlessM4T's tiny model (a test of test_multi_role_attention.py)
took 253 s at torch's default of 2 threads and 21 s at 1.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch starts its pool here; inherited by train.py runs
# Inductor compiles in each rank's own process, not in a pool of fresh interpreters per rank (its default on 2 cores:
# two workers, each importing torch): test_compile's tp=2 batch took 70 CPU-s instead of 78 (2026-12-07). The same
# code is generated either way.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests import timing  # noqa: E402

torch.set_num_threads(1)

LONGEST_FIRST = [  # by their CPU-seconds in one whole run at -n 3 (2026-12-07, TP_TRAIN_TEST_CPU, a quiet 2-core
    # machine: 2,133 CPU-s in 1,168 s), those that wait out limits (their wall time well above their CPU) moved up
    "test_cluster_launch.py",  # 150 CPU-s: torchrun restarts, Slurm requeue, two agents as two nodes
    "test_hang.py",  # 34 CPU-s, ~150 s: train.py runs that wait out a hang limit
    "test_rank_failure.py",  # 43 CPU-s, ~100 s
    "test_compile.py",  # 126: the inductor compile at tp=2
    "test_layout_train.py",  # 83: 8-rank train.py runs
    "test_attention_splits.py",  # 79
    "test_finetune.py",  # 78
    "test_hf_train.py",  # 73: train.py per family at tp 1 and 2
    "test_planner_families.py",  # 65: one start-up for every family
    "test_compiled_loss.py",  # 62
    "test_simulate.py",  # 52
    "test_choose.py",  # 51
    "test_hsdp.py",  # 50: one test
    "test_pipeline_train.py",  # 49
    "test_pipeline_composed.py",  # 44
    "test_pipeline_hf.py",  # 44
    "test_expert_parallel_train.py",  # 43
    "test_expert_parallel_lightning.py",  # 42
    "test_multi_role_attention.py",  # 40
    "test_context_parallel_train.py",  # 38
    "test_preflight.py",  # 37: every refusal in one start-up
    "test_elastic.py",  # about 35 (added since): three train.py runs of 4, 4 and 2 ranks
    "test_fsdp.py",  # 34
    "test_any_transformer.py",  # 34
    "test_fsdp_checkpoint.py",  # 32
    "test_train_cases.py",  # 32
    "test_train_app.py",  # 31
    "test_docs.py",  # 29
    "test_checkpoint.py",  # 27
    "test_without_lightning.py",  # 24: four torchrun ranks, fresh interpreters
    "test_gpu_check.py",  # 24
    "test_memory.py",  # 23: gpt_small's measured peaks
    "test_context_parallel_resume.py",  # 22
    "test_launch.py",  # 21: spawned ranks, fresh interpreters
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present: keep the order made below
        config.option.loadscopereorder = False
    timing.join_cpu_cgroup(os.environ.get("PYTEST_XDIST_WORKER", "main"))
    if "PYTEST_XDIST_WORKER" not in os.environ:  # once, before the workers start
        _compile_project()


def _compile_project() -> None:
    """Writes the project's bytecode before any test starts a fresh interpreter (a torchrun worker, a spawned or
    restarted rank, a script): where PYTHONDONTWRITEBYTECODE is set (as on CI's machines) none is ever written, and
    each of them compiled tp_train, models and the tests from source again, 0.6-1.0 CPU-s of its 7 to import train.py
    (2026-12-07). Unchanged files are skipped; the interpreter checks each .pyc against its source's time and size."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for package in ("tp_train", "models", "tests"):
        compileall.compile_dir(root / package, quiet=2, workers=1)
    compileall.compile_file(root / "train.py", quiet=2)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = timing.cpu_seconds()
    yield
    if before is not None:
        timing.record_cpu(item.nodeid, timing.cpu_seconds() - before)


def pytest_collection_modifyitems(config, items):
    position = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep theirs


# Tests marked slow here rather than in their files (one list, so that files other work is changing stay as they
# are): each took 15 s or more in a timing run of the fast tier on the 2-core machine at a load average of 16-21
# (shared with other jobs, so about 2 s and more idle), or is a module fixture's first test that pays for the whole
# fixture (ranks running every family or model of the file). All parameters of a test are marked alike.
SLOW_HERE = {
    "test_fsdp.py::test_fsdp_with_activation_checkpointing_and_a_model_built_on_meta",
    "test_fsdp.py::test_accumulating_two_micro_batches_is_one_big_batch",
    "test_fsdp.py::test_fsdp_precisions_train_and_skip_a_non_finite_step_on_every_rank",
    "test_fsdp.py::test_fsdp_dp2_tp2_trains_like_plain_lightning_with_a_quarter_of_the_state",
    "test_fsdp_checkpoint.py::test_an_fsdp_checkpoint_exports_to_hugging_face",
    "test_fsdp_checkpoint.py::test_fsdp_and_ddp_checkpoints_share_one_layout_biases_included",
    "test_comm.py::test_collectives_match_their_docstrings",
    "test_checkpoint_safety.py::test_getattr_in_dcp_metadata_reaches_only_enum_members",
    "test_distributed.py::test_a_dropped_rendezvous_connection_starts_the_ranks_again",
    "test_any_transformer.py::test_t5s_relative_position_bias_is_split_with_its_heads",
    "test_any_transformer.py::test_the_planner_reads_reused_layers_shared_bias_tables_and_per_head_biases",
    "test_attention_splits.py::test_swiftformers_pointwise_conv_mlps_split_and_its_additive_attention_kept_whole",
    "test_attention_splits.py::test_the_split_attentions_match_unsharded",
    "test_attention_splits.py::test_perceivers_one_head_classification_decoder_keeps_its_attention_whole_and_splits_its_mlp",
    "test_attention_splits.py::test_the_time_major_attention_runs_on_local_heads",
    "test_checkpoint_safety.py::test_dcp_metadata_reads_with_its_enum_members_pickled_by_value_or_by_name",
    "test_planner_families.py::test_gpt_oss_holds_at_most_0_6_of_its_parameters_per_rank_at_tp2",
    "test_async_writer.py::test_a_process_that_exits_right_after_a_save_writes_it_first",
    "test_fsdp_checkpoint.py::test_fsdp_checkpoint_validates_the_same_at_one_device_tp2_and_dp2_tp2_ddp",
    "test_fsdp_checkpoint.py::test_fsdp_resume_gives_the_same_losses_as_training_straight_through",
    "test_hf_families.py::test_preset_sharded_model_matches_unsharded",
    "test_multi_role_attention.py::test_a_parameter_acting_on_local_heads_gets_an_entry_of_its_own",
    "test_multi_role_attention.py::test_layers_run_twice_at_two_shapes_are_planned_as_one_split",
    "test_multi_role_attention.py::test_norms_held_in_every_probe_forward_leave_a_later_attention_plannable",
    "test_attention_splits.py::test_funnels_per_head_parameters_are_split_with_the_heads",
    "test_attention_splits.py::test_a_per_head_parameter_of_an_attention_kept_whole_stays_out_of_its_pattern",
    "test_attention_splits.py::test_pvt_v2s_attention_reshapes_to_the_local_width",
    "test_attention_splits.py::test_mobileberts_bottlenecks_split_by_their_input_and_its_tied_embedding_whole",
    "test_attention_splits.py::test_perceivers_attentions_split_by_heads_and_its_embedding_read_by_the_decoder_whole",
    "test_layernorm_parallel.py::test_a_layernorm_over_split_features_matches_unsharded",
    "test_docs.py::test_documented_zoo_commands_parse",
    "test_planner_families.py::test_blts_cross_attention_is_planned_where_its_patches_are_longer_than_a_byte",
    "test_multi_role_attention.py::test_per_head_biases_of_a_conformer_attention_are_split_with_its_heads",
    "test_planner_families.py::test_the_family_shards_and_matches_unsharded",
    "test_planner_families.py::test_codegens_attention_is_split_by_its_head_groups",
    "test_planner_families.py::test_inkling2s_full_layer_views_its_convolutions_heads_locally",
    "test_planner_families.py::test_xlstms_zero_gate_and_per_head_norm_are_planned",
    "test_planner_families.py::test_falcon_h1s_mup_vector_is_split_with_in_proj_and_its_gated_norm_refused",
    "test_planner_families.py::test_inklings_short_convolutions_split_with_the_kv_heads_they_convolve",
    "test_planner_families.py::test_electras_embedding_projection_is_no_column_of_the_first_query",
    "test_compile.py::test_a_model_with_dropout_keeps_switching_random_streams_when_compiled",
    "test_finetune.py::test_model_path_brings_its_tokenizer_to_the_data_unless_data_tokenizer_path_says_otherwise",
    "test_checkpoint_safety.py::test_the_saved_checkpoint_reads_as_data_and_more_than_data_needs_the_opt_in",
    "test_strategy_checkpoint.py::test_checkpoint_saved_at_tp2_validates_the_same_at_tp1_tp4_and_exports",
    "test_strategy_checkpoint.py::test_resume_gives_the_same_losses_as_training_straight_through",
    "test_overlap.py::test_overlap_matches_unsharded",
    "test_preemption.py::test_a_preempted_fit_resumes_the_train_loader_mid_epoch",
    "test_parallelize.py::test_sharded_model_matches_unsharded",
    "test_precision.py::test_precision_at_tp2_within_its_bound_of_plain_lightning",
    "test_probe.py::test_models_whose_default_cache_cannot_be_built_are_auto_planned_and_match_unsharded",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_itemcollected(item):
    if f"{item.path.name}::{item.originalname}" in SLOW_HERE:
        item.add_marker(pytest.mark.slow)
