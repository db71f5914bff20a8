"""A checkpoint path as a run prints it (`resuming from <run>/checkpoints/step000020.ckpt`) pastes back unquoted as
`python train.py ckpt_path=...`: new checkpoints are named without `=`."""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate

from tests.test_configs import _compose


def test_checkpoints_are_named_without_equals_and_list_in_step_order(tmp_path):
    checkpoint = instantiate(_compose(tmp_path, []).callbacks.checkpoint)
    names = [Path(checkpoint.format_checkpoint_name({"epoch": torch.tensor(0), "step": torch.tensor(step)})).name
             for step in (9, 10, 200, 1000)]  # fmt: skip
    assert names == ["step000009.ckpt", "step000010.ckpt", "step000200.ckpt", "step001000.ckpt"]
    assert names == sorted(names)
