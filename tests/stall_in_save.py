"""Runs train.py as `python tests/stall_in_save.py MARKER [overrides...]`: in the launching process (global rank 0),
the background write of the second checkpoint stops once its shards are written to `<name>.ckpt.tmp`, before the
renames that complete it, writes MARKER and waits there, so that a test can SIGKILL the job in the middle of a
save. The overrides, and so the command auto-resume compares, are exactly train.py's."""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    marker, *overrides = sys.argv[1:]
    save, saves = dcp.save, []

    def save_then_stall(state, *args, checkpoint_id=None, **kwargs):
        result = save(state, *args, checkpoint_id=checkpoint_id, **kwargs)
        if Path(checkpoint_id).name.endswith(".ckpt.tmp"):
            saves.append(checkpoint_id)
            if len(saves) == 2:
                Path(marker).write_text(str(checkpoint_id))
                time.sleep(3600)  # until the test kills the job
        return result

    dcp.save = save_then_stall  # tp_train.checkpoint.dcp calls dcp.save
    sys.argv = [str(ROOT / "train.py"), *overrides]  # what the child ranks re-run: plain train.py
    sys.path[0] = str(ROOT)
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
