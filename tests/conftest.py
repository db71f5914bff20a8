"""The order test files start in under `make test` (pytest-xdist, `--dist loadfile`: each worker takes whole files).

xdist's default hands out files with the most tests first, which leaves the files of one or a few long tests
(a `train.py` run, an inductor compile) to the end, where one worker runs them alone while the other sits idle.
The files that take longest start first instead (in this order, by their times in CI on 2 cores); every other
file follows in collection order and fills in around them.
"""

from __future__ import annotations

LONGEST_FIRST = [
    "test_finetune.py",
    "test_compile.py",
    "test_cluster_launch.py",
    "test_preemption.py",
    "test_train_app.py",
    "test_planner_families.py",
    "test_launch.py",
    "test_export.py",
    "test_checkpoint_safety.py",
    "test_preflight.py",
]


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist present: keep the order made below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    position = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: position.get(item.path.name, len(LONGEST_FIRST)))  # stable: the rest keep theirs
