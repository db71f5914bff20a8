PYTHON ?= python3

.PHONY: setup test lint

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

# The README's test command; .ci/run calls it.
test: setup
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check .
