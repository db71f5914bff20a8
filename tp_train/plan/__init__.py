"""Plans: the style vocabulary, family records and presets, finding or inferring a model's plan, applying and verifying
it, and `parallelize`, which does all of it. Imports `checkpoint` and `parallel` below it."""
