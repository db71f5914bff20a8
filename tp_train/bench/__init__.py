"""The benchmark: `python -m tp_train.bench --help`."""
