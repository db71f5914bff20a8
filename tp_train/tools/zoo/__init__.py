"""`python -m tp_train.tools.zoo`: every Hugging Face family of a task (causal LM by default; masked LM, seq2seq LM,
speech seq2seq, image classification, CLIP-style dual encoders and their towers: `tp_train.tools.zoo_tasks`), built
from a tiny config with random weights, sharded with no plan given (`tp_train.parallelize`, verification on, as by
default) on gloo CPU ranks, and compared with the unsharded model: outputs, every gradient and three SGD steps of
losses, within 1e-5.

Each family lands in one class:

- `pass`: sharded, and it matches (a `*` marks one whose attention was kept whole: the rest is sharded);
- `refused`: `parallelize` refused it in one line (a plan it cannot apply, or verification found a difference);
- `round-off`: beyond 1e-5 in float32 but within 1e-9 in float64 (the same function, summed in another order);
- `WRONG`: sharded without complaint, but it computes something else (the worst outcome: none should be here);
- `unsharded`: it matches, but more than 15% of the block matrices that train are whole on every rank, at any tp
  (some attention or MLP left whole without the planner saying so; k and v of kv heads fewer than the ranks, held as
  far split as their heads allow, count as split), or, with an attention the planner keeps whole, less than 1/tp +
  0.15 of them are split;
- `killed`: a rank was killed by a signal it did not get from the zoo (the kernel's out-of-memory killer): checked
  again alone once the other families are done, and `killed` only if it is killed again;
- `error`: anything else (a crash, or no result within `--timeout` seconds);
- `unbuildable`: no tiny model could be built from the family's config (not counted among the families);
- `no blocks`: its repeated blocks hold no Linear layer (a convolutional network: ResNet, MobileNet), nothing for a
  column/row split to take (not counted among the families).

Each family runs in its own processes (one per rank, on a free port), `--jobs` families at a time, so a family that
hangs or crashes takes only itself down. Options: `--task masked-lm` (or `all`), `--families llama,bloom`, `--tp 2`,
`--jobs 2`, `--timeout 180`, `--output zoo.json`, `--kv-heads 2` (grouped-query attention: 2 kv heads under the 4
query heads, in every (sub-)config that has kv heads). A setting of the configs (the same fields set in every
family of a run) is `run_zoo(..., fields={...})`.
"""

from tp_train.tools.zoo.check import CLASSES, check_family, has_block_linears
from tp_train.tools.zoo.configs import (
    SIZES,
    TOLERANCE,
    VOCAB,
    WIDTHS,
    build_family,
    families,
    family_fields,
    tiny_config,
)
from tp_train.tools.zoo.runner import run_zoo, summary

__all__ = [
    "CLASSES", "family_fields", "SIZES", "TOLERANCE", "VOCAB", "WIDTHS", "build_family", "check_family", "families",
    "has_block_linears", "run_zoo", "summary", "tiny_config",
]  # fmt: skip
