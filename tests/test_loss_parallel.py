"""The app's loss is vocabulary-parallel: `CausalLMModule` under `TensorParallelStrategy(loss_parallel=True)` (the
config's default) computes the loss from each rank's slice of the vocabulary, never holds the full (tokens, vocab)
logits on a rank, and logs the losses of the gathered path."""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.data import DataLoader

import tp_train
from models import GPT, GPTConfig
from tests.distributed import run_on_ranks

VOCAB = 1001  # no tp divides it: the sharded head is padded
BATCH, SEQ, WIDTH = 4, 16, 32  # tokens per step (64) > width, so the logits are the largest tensor by far
STEPS = 4
CHUNK = 16  # tokens per chunk of the loss


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an operator returns while the mode is on."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


class TrainingStepRecorder(L.Callback):
    """Each step's loss, and the largest tensor made during the training steps (forward, loss, backward, AdamW)."""

    def __init__(self):
        self.losses, self.mode = [], LargestTensor()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.mode.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.mode.__exit__(None, None, None)
        self.losses.append(outputs["loss"].item())


def _train(rank, world_size, loss_parallel, fused_loss=None, plan=None):
    import tp_train.parallel.cross_entropy as cross_entropy

    cross_entropy.CHUNK_BYTES = CHUNK * -(-VOCAB // world_size) * 4  # chunks of CHUNK tokens
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=WIDTH, dropout=0.0))
    module = tp_train.CausalLMModule(model, functools.partial(torch.optim.AdamW, lr=1e-2))
    recorder = TrainingStepRecorder()
    trainer = L.Trainer(
        strategy=tp_train.TensorParallelStrategy(
            tensor_parallel_size=world_size, loss_parallel=loss_parallel, fused_loss=fused_loss, plan=plan
        ),
        accelerator="cpu",
        devices=world_size,
        max_steps=STEPS,
        callbacks=[recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    data = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(data, batch_size=BATCH))
    return recorder.losses, recorder.mode.largest


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "fused"), [(2, False), (2, None), (4, None)], ids=["tp2", "tp2-fused", "tp4-fused"])
def test_the_app_loss_never_holds_full_logits_and_logs_the_gathered_losses(tp, fused):
    """`CausalLMModule` says its head feeds only the loss: by default (fused_loss=None) head and loss are fused, and
    no rank holds even its own shard of the logits, only a chunk's."""
    full_logits = BATCH * SEQ * VOCAB
    shard_logits = BATCH * SEQ * -(-VOCAB // tp)
    gathered = run_on_ranks(_train, tp, False, timeout=240)
    sharded = run_on_ranks(_train, tp, True, fused, timeout=240)
    for rank in range(tp):
        gathered_losses, gathered_largest = gathered[rank]
        losses, largest = sharded[rank]
        assert gathered_largest >= full_logits  # the control: the gathered path does hold them
        assert largest <= shard_logits < full_logits, (largest, full_logits)
        if fused is None:
            assert largest < shard_logits, (largest, shard_logits)  # a chunk's logits, and the head's weight shard
        assert len(losses) == STEPS
        assert max(abs(a - b) for a, b in zip(losses, gathered_losses, strict=True)) < 1e-5, (losses, gathered_losses)


def _without_a_sharded_head(rank, world_size):
    from tests.test_parallelize import SwiGLUModel

    plan = {pattern: style for pattern, style in SwiGLUModel.tp_plan.items() if pattern != "head"}
    try:
        tp_train.parallelize(SwiGLUModel(), plan=plan, loss_parallel=True)
        message = None
    except ValueError as error:
        message = str(error)
    # Through the strategy, whose loss takes either logits: loss_parallel falls back to whole logits (issue 41).
    whole_head = {f"model.{name}": style for name, style in GPT.tp_plan.items() if name not in ("tok_emb", "lm_head")}
    fits = {}
    for loss_parallel in (True, False):
        losses, largest = _train(rank, world_size, loss_parallel, plan=whole_head)
        fits[loss_parallel] = losses, largest
    return message, fits


def test_loss_parallel_without_a_vocabulary_sharded_head_is_one_line_or_whole_logits_through_the_strategy():
    """`parallelize(loss_parallel=True)` refuses a plan that leaves the head whole (its caller's vocabulary-parallel
    loss would be wrong); the strategy, which computes the loss itself, takes the whole logits instead, with one info
    line (CPM-Ant, Mllama, Moshi through train.py): the losses of `loss_parallel=False`, the full logits held."""
    for message, fits in run_on_ranks(_without_a_sharded_head, 2, timeout=240):
        assert message is not None and "\n" not in message
        assert "loss_parallel=True" in message and "colwise_gather_output" in message and "found none" in message
        (losses, largest), (whole_losses, _) = fits[True], fits[False]
        assert len(losses) == STEPS and losses == whole_losses, (losses, whole_losses)
        assert largest >= BATCH * SEQ * VOCAB


def _olmoe_losses(rank, world_size):
    """OLMoE's own plan gathers q, k and v as well as the LM head (its q/k norms span every head): only the head,
    its output embedding, keeps its logits sharded (issue 41)."""
    import copy

    import torch.nn.functional as F

    from tp_train.tools.zoo.configs import build_family

    torch.manual_seed(0)
    model = build_family("causal-lm", "olmoe").eval()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, model.config.vocab_size, (2, 9))
    inputs, targets = idx[:, :-1], idx[:, 1:]
    expected = F.cross_entropy(reference(inputs).logits.flatten(0, 1), targets.flatten())
    tp_train.parallelize(model, loss_parallel=True, verify=False)
    logits = model(inputs).logits
    vocab = model.config.vocab_size
    loss = tp_train.vocab_parallel_cross_entropy(logits, targets, torch.distributed.group.WORLD, vocab)
    return logits.shape[-1], -(-vocab // world_size), abs(loss.item() - expected.item())


@pytest.mark.slow
def test_loss_parallel_keeps_only_the_output_embedding_sharded_where_other_layers_gather_too():
    for local, expected, error in run_on_ranks(_olmoe_losses, 2):
        assert local == expected and error < 1e-5, (local, expected, error)
