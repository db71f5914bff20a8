"""The benchmark: `python -m tp_train.tools.bench --help`."""
