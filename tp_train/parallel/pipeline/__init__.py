"""Pipeline parallelism on torch's own `torch.distributed.pipelining`: a model cut into stages that keep its
parameter names (`stage`), the schedules offered and refused (`schedules`), tied parameters across stages (`ties`),
and a model run as a pipeline for one training step (`runner.Pipeline`). Where a model splits is decided in
`tp_train.training.pipeline_split`. Nothing here knows of Lightning."""

from tp_train.parallel.pipeline.runner import Pipeline, TokenWeightedCrossEntropy
from tp_train.parallel.pipeline.schedules import REFUSED, SCHEDULES, schedule_named

__all__ = ["REFUSED", "SCHEDULES", "Pipeline", "TokenWeightedCrossEntropy", "schedule_named"]
