"""Applying a plan `deciding/` resolved: each planned module swapped for its parallel layer or region (`apply`),
peft adapters split beside them (`adapters`), and sequence parallelism on the blocks it leaves (`sequence_parallel`).
The split code it shares with deciding (local views, shard specs, meta init) sits in `plan/` itself."""
