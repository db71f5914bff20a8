"""Plans: the style vocabulary, family records and their presets, finding or inferring a model's plan (the
auto-planner and its probe), validating and applying it, verifying the result, sequence parallelism and activation
checkpointing over the blocks it finds, and `parallelize`, which does all of it. Imports `checkpoint` and `parallel`
below it."""
