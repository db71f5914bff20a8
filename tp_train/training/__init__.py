"""Training's parallelism in one order, without Lightning: `parallelize_for_training` applies every dimension to a
model and returns the `ParallelTraining` a step loop drives (docs/without-lightning.md)."""

from tp_train.training.apply_order import TrainingOptions, parallelize_for_training, replicate
from tp_train.training.parallel_training import ClippingGroups, ParallelTraining

__all__ = ["ClippingGroups", "ParallelTraining", "TrainingOptions", "parallelize_for_training", "replicate"]
