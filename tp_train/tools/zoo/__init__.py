"""`python -m tp_train.tools.zoo`: every Hugging Face family of a task (causal LM by default; masked LM, seq2seq LM,
speech seq2seq, image classification, CLIP-style dual encoders and their towers: `tp_train.tools.zoo_tasks`), built
from a tiny config with random weights, sharded with no plan given (`tp_train.parallelize`, verification on, as by
default) on gloo CPU ranks, and compared with the unsharded model: outputs, every gradient and three SGD steps of
losses, within 1e-5. `--init`: the init column instead (`tp_train.tools.zoo.init_check`), each family built under
`deferred_init` and sharded, against its eager build's initialisation.
"""

from tp_train.tools.zoo.check import CLASSES, check_family, has_block_linears
from tp_train.tools.zoo.configs import SIZES, TOLERANCE, VOCAB, build_family, family_fields, tiny_config
from tp_train.tools.zoo.runner import run_zoo, summary
from tp_train.tools.zoo_tasks import task_families as families

__all__ = [
    "CLASSES", "family_fields", "SIZES", "TOLERANCE", "VOCAB", "build_family", "check_family", "families",
    "has_block_linears", "run_zoo", "summary", "tiny_config",
]  # fmt: skip
