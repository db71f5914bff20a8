"""Plans: the tensor-parallel plan's three jobs, each a sub-package (`deciding/`: resolve, families, the auto-planner
and its probes; `applying/`: layer swaps, adapters, sequence parallelism; `checking/`: verification and the region
check), the vocabulary all three share here (styles, probes and their input, local views, meta init, gradient hooks,
block layout, ...), and `parallelize`, which runs the three. Imports `checkpoint` and `parallel` below it."""
