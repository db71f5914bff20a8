"""Tools beside training: the benchmark, export to Hugging Face (library and `tp-train-export`), the memory
estimate and the activation-memory count. They use `plan` and below, never `lightning` or `app`; the benchmark
and the activation count measure the project's reference model, `models.GPT`."""
