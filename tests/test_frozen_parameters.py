"""Frozen parameters (requires_grad=False) under tensor parallelism, through Lightning against plain Lightning on
one device: a sharded embedding, a sharded projection and a replicated norm frozen (the norm's gradient all-reduce
hook is what sequence parallelism registers); clipping by the norm of the trainable gradients only, the optimizer
leaving frozen parameters alone, and a checkpoint restoring them."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import run_on_ranks
from tests.lightning_helpers import LitLM, fit, loader, make_trainer
from tests.parity import full_tensors
from tests.test_parallelize import _gpt

STEPS = 4
FROZEN = ("tok_emb.weight", "blocks.0.ln_1.weight", "blocks.1.attn.q.weight")


def frozen_model():
    """Our GPT (sequence parallelism needs its shape) with a vocabulary-parallel embedding, a column-parallel
    projection and a replicated norm frozen."""
    model = _gpt()
    for name, param in model.named_parameters():
        param.requires_grad_(name not in FROZEN)
    return model


def _full_parameters(trainer, module) -> dict[str, torch.Tensor]:
    if trainer is None:
        return {name: param.detach().clone() for name, param in module.model.named_parameters()}
    return full_tensors(module.model, trainer.strategy.tensor_parallel_group, grads=False)


def _train(rank, world_size, tp, sequence_parallel, directory):
    torch.manual_seed(0)
    initial = dict(frozen_model().named_parameters())
    strategy_kwargs = dict(sequence_parallel=sequence_parallel) if tp else None
    path = f"{directory}/frozen.ckpt" if tp else None
    trainer, recorder = fit(
        tp,
        STEPS,
        module_kwargs=dict(build=frozen_model),
        gradient_clip_val=0.5,
        strategy_kwargs=strategy_kwargs,
        save_to=path,
    )
    trained = _full_parameters(trainer if tp else None, trainer.lightning_module)
    result = {
        "losses": recorder.losses,
        "norms": recorder.clip_norms if tp else recorder.local_norms,
        "frozen_moved": max((trained[name] - initial[name]).abs().max().item() for name in FROZEN),
        "trained": trained,
    }
    if tp:  # the checkpoint, loaded into a fresh model built with another seed
        torch.manual_seed(123)
        check = make_trainer(tp, strategy_kwargs=strategy_kwargs)
        module = LitLM(build=frozen_model)
        check.validate(module, loader(tp, 1), ckpt_path=path, verbose=False)
        loaded = _full_parameters(check, module)
        result["checkpoint_error"] = max((loaded[name] - trained[name]).abs().max().item() for name in trained)
        result["still_frozen"] = sorted(n for n, p in module.model.named_parameters() if not p.requires_grad)
    return result


@pytest.fixture(scope="module")
def plain_lightning():
    return run_on_ranks(_train, 1, None, False, None)[0]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2+sp"])
def test_frozen_parameters_train_clip_and_checkpoint_like_plain_lightning(sequence_parallel, plain_lightning, tmp_path):
    reference = plain_lightning
    assert reference["frozen_moved"] == 0.0 and reference["norms"][0] > 0.5  # frozen in torch; clipping active
    for rank, result in enumerate(run_on_ranks(_train, 2, 2, sequence_parallel, str(tmp_path), timeout=300)):
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5), rank
        assert result["norms"] == pytest.approx(reference["norms"], rel=1e-5), rank  # frozen grads not counted
        assert result["frozen_moved"] == 0.0, rank
        assert result["checkpoint_error"] == 0.0, rank
        assert result["still_frozen"] == sorted(FROZEN), rank
