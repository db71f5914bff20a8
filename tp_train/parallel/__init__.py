"""Megatron-style tensor parallelism itself: collectives (f/g), parallel layers, `ShardSpec` and the sharding
arithmetic, vocabulary-parallel cross-entropy, the RNG tracker, gradient clipping and the mesh axes.
"""
