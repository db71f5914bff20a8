"""Tensor-parallel state on disk: distributed checkpoints (torch.distributed.checkpoint) saved and loaded at any
tp, their checks, and pretrained safetensors weights read slice by slice. Imports `tp_train.parallel` only."""
