PYTHON ?= python3

.PHONY: setup train test lint

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# README's first command: the default training, tp=2 on CPU ranks when there is no GPU.
train: setup
	WANDB_MODE=$${WANDB_MODE:-offline} $(PYTHON) train.py tp=2

# README's second command; .ci/run calls it.
test: setup
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
