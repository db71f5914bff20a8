"""The contenders of the benchmark: one training step (forward, backward, AdamW) of the same GPT, built three ways."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from models import GPT, GPTConfig
from tp_train.parallel.cross_entropy import vocab_parallel_cross_entropy
from tp_train.parallel.invariant import FAST
from tp_train.parallel.sharding import local_part
from tp_train.plan.parallelize import parallelize
from tp_train.tools.optimizer import adamw


@dataclass(frozen=True)
class Size:
    name: str
    n_layer: int
    n_embd: int
    n_head: int
    batch: int
    seq: int
    vocab: int

    def config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, block_size=self.seq, n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd
        )


# Small enough that eager overhead dominates, then two sizes where the matmuls do.
SIZES = {
    "small": Size("small", n_layer=2, n_embd=128, n_head=4, batch=4, seq=64, vocab=1024),
    "medium": Size("medium", n_layer=2, n_embd=256, n_head=8, batch=8, seq=128, vocab=2048),
    "large": Size("large", n_layer=2, n_embd=512, n_head=8, batch=8, seq=128, vocab=2048),
}


@dataclass(frozen=True)
class Contender:
    kind: str  # "plain", "ours" or "native"
    tp: int
    threads: int = 1  # intra-op threads per rank
    sequence_parallel: bool = False  # ours only
    activation_checkpointing: bool = False  # ours only
    compiled: bool = False
    overlap: bool = True  # ours only: collectives in backward overlapped with the weight gradients
    numerics: str = FAST  # ours only: "invariant", every split sum in one fixed order (docs/invariant-numerics.md)

    @property
    def name(self) -> str:
        suffix = f" x{self.threads} threads" if self.threads > 1 else ""
        suffix += " +SP" if self.sequence_parallel else ""
        suffix += " +AC" if self.activation_checkpointing else ""
        suffix += " compiled" if self.compiled else ""
        suffix += " no overlap" if not self.overlap else ""
        suffix += f" {self.numerics}" if self.numerics != FAST else ""
        return f"{self.kind} tp={self.tp}{suffix}"

    @property
    def variant(self) -> bool:
        """Sequence parallelism, activation checkpointing, no overlap or invariant numerics: compared with plain
        `ours`, not native."""
        return self.sequence_parallel or self.activation_checkpointing or not self.overlap or self.numerics != FAST


class TrainingStep:
    """A model, its AdamW and a fixed batch; calling it runs one full training step. `loss(logits, targets)`
    defaults to the model's own (full logits); `context` wraps forward, loss and backward (native's `loss_parallel`)."""

    def __init__(self, model: nn.Module, batch: torch.Tensor, loss=None, context=contextlib.nullcontext):
        self.model = model
        self.optimizer = adamw(model.parameters(), lr=1e-4)  # the same implementation as training: foreach on CUDA
        self.inputs, self.targets = batch[:, :-1], batch[:, 1:]
        self.loss, self.context = loss, context

    def __call__(self) -> float:
        with self.context():
            if self.loss is None:
                _, loss = self.model(self.inputs, self.targets)
            else:
                loss = self.loss(self.model(self.inputs), self.targets)
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    def model_state_bytes(self) -> int:
        """Bytes of this rank's parameters, their gradients (as large as the parameters) and optimizer states."""
        unique = {id(p): p for p in self.model.parameters()}.values()  # a tied parameter once
        params = sum(local_part(p).numel() * p.element_size() for p in unique)
        states = sum(
            local_part(t).numel() * t.element_size()
            for state in self.optimizer.state.values()
            for t in state.values()
            if torch.is_tensor(t)
        )
        return 2 * params + states

    def resident_bytes(self) -> int:
        """Bytes of the tensors that live between steps: parameters and optimizer states (gradients are freed)."""
        return self.model_state_bytes() - sum(local_part(p).numel() * p.element_size() for p in self.model.parameters())


def build(contender: Contender, size: Size, group: ProcessGroup | None, device: torch.device) -> TrainingStep:
    """The training step of `contender` on this rank (every rank of its group calls this, in the same order)."""
    torch.manual_seed(0)
    model = GPT(size.config()).to(device)
    generator = torch.Generator().manual_seed(1)
    batch = torch.randint(0, size.vocab, (size.batch, size.seq + 1), generator=generator).to(device)
    if contender.kind == "ours":
        parallelize(
            model,
            group,
            loss_parallel=True,
            sequence_parallel=contender.sequence_parallel,
            activation_checkpointing=contender.activation_checkpointing,
            compile=contender.compiled,
            overlap=contender.overlap,
            numerics=contender.numerics,
        )
        loss = functools.partial(
            vocab_parallel_cross_entropy, group=group, vocab_size=size.vocab, in_place_backward=True,
            numerics=contender.numerics,
        )  # fmt: skip
        return TrainingStep(model, batch, loss)
    if contender.kind == "native":
        native_parallelize(model, DeviceMesh.from_group(group, device.type))
        if contender.compiled:
            model.compile()
        return TrainingStep(model, batch, _full_loss, context=loss_parallel)
    if contender.compiled:
        model.compile()
    return TrainingStep(model, batch)


def _full_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def native_plan(model: GPT) -> dict:
    plan = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(use_local_output=False),  # logits Shard(-1), for `loss_parallel()`
    }
    for index in range(len(model.blocks)):
        prefix = f"blocks.{index}"
        plan |= {f"{prefix}.{name}": ColwiseParallel() for name in ("attn.q", "attn.k", "attn.v", "mlp.fc")}
        plan |= {f"{prefix}.{name}": RowwiseParallel() for name in ("attn.proj", "mlp.proj")}
    return plan


def native_parallelize(model: GPT, mesh: DeviceMesh) -> GPT:
    parallelize_module(model, mesh, native_plan(model))
    model.lm_head.weight = model.tok_emb.weight  # both are Shard(0) over the vocabulary: tie them again
    return model
