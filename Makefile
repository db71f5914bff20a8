# The environment everything installs into and runs in: an active virtual environment or conda environment as it
# is, else the project's own .venv (created by `make setup` from the system python3). `make PYTHON=... test` picks
# an interpreter yourself.
ifdef VIRTUAL_ENV
PYTHON ?= $(VIRTUAL_ENV)/bin/python
else ifdef CONDA_PREFIX
PYTHON ?= $(CONDA_PREFIX)/bin/python
else
PYTHON ?= .venv/bin/python
endif

.PHONY: setup train test test-fast test-system-python docs lint gpu-wheels gpu-check

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# README's first command: the default training, tp=2 on CPU ranks when there is no GPU.
train: setup
	WANDB_MODE=$${WANDB_MODE:-offline} $(PYTHON) train.py tp=2

# README's second command; .ci/run calls it. Three pytest workers (pytest-xdist), each taking whole test files, on
# the 2-core machine: a distributed test waits much of its time (a rank held stopped until the hang limit, ranks
# idle while the first one plans, torchrun restarting), and a third worker fills those cores (docs/performance.md:
# 801 s against 926 s at two, 2026-11-27). TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 3
test: setup
	$(PYTHON) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# The edit-test loop: every test not marked slow (under 3 minutes on 2 cores; docs/install.md). `make test` stays the
# whole suite and CI's command. Two workers here: each worker's start-ups (collection, its rank fork server, its
# train.py server) cost more than a third worker wins back on this tier, which has few waits (2026-12-06: 114 s and
# 157 CPU-s at two, 122 s and 183 CPU-s at three).
TEST_FAST_WORKERS ?= 2
test-fast: setup
	$(PYTHON) -m pytest -q -n $(TEST_FAST_WORKERS) --dist loadfile -m "not slow"

# The docs site from docs/ (mkdocs.yml) into site/; tests/test_docs.py runs the same build.
docs: setup
	$(PYTHON) -m mkdocs build --strict

# The checkpoint readers again under the machine's system python3 when it is another interpreter than the one
# above (Debian 12's 3.11.2 pickles differently from CI's python3); .ci/run calls it after `make test`.
# test_checkpoint_safety writes a checkpoint with train.py and reads it with every loader, and reads DCP metadata
# with its enum members pickled either way; the resharding round trips of test_checkpoint pickle nothing else.
SYSTEM_PYTHON ?= /usr/bin/python3
test-system-python: setup
	PYTHON=$(PYTHON) SYSTEM_PYTHON=$(SYSTEM_PYTHON) bash scripts/system_python_tests.sh tests/test_checkpoint_safety.py

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .

# The GPU check (docs/performance.md): `make gpu-wheels` downloads, here, the wheels a GPU machine without a package
# index lacks (scripts/gpu_wheels.py; into wheelhouse/, which travels beside the tree); `make gpu-check` runs
# scripts/gpu_check.sh (without a CUDA device it checks the wheelhouse and says so).
gpu-wheels:
	rm -rf wheelhouse
	$(PYTHON) scripts/gpu_wheels.py download wheelhouse

gpu-check:
	bash scripts/gpu_check.sh
