"""The strategy's loss with the head and the loss fused by default (`fused_loss=None`): a model that transforms its
head's output before the loss (Gemma-3n's and Cohere-2's final logit soft-cap, Beam's scale: issue 41) was refused at
its first step; it now trains unfused, told so once. Single process: the step is the model's call, the head a
`HeadLossFusion` as `parallelize` sets it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn as nn

from tp_train.errors import HeadOutputChangedError
from tp_train.lightning.loss import StrategyLoss
from tp_train.parallel.fused_cross_entropy import HeadLossFusion


class _SoftCappedHead(nn.Module):
    """A head whose logits the model soft-caps after it, as Gemma-3n's `final_logit_softcapping`."""

    head_feeds_only_loss = True

    def __init__(self):
        super().__init__()
        self.lm_head = nn.Linear(4, 8, bias=False)
        self.lm_head.tp_loss_fusion = HeadLossFusion()

    def forward(self, hidden):
        fusion = self.lm_head.tp_loss_fusion
        logits = fusion.hold(hidden, self.lm_head) if fusion.active else self.lm_head(hidden)
        return 30.0 * torch.tanh(logits / 30.0)


def _step(loss: StrategyLoss, model: _SoftCappedHead, calls: list):
    def step():
        calls.append(model.lm_head.tp_loss_fusion.active)
        output = model(torch.ones(2, 4))
        for fusion in loss._fusions(model):  # what the loss does with the model's output
            fusion.take(output)
        return output

    return loss.step(model, step)


def test_a_model_changing_its_logits_after_the_head_falls_back_to_the_unfused_loss_once(caplog):
    caplog.set_level(logging.INFO)
    loss, model, calls = StrategyLoss(loss_parallel=True, fused=None, compile=False), _SoftCappedHead(), []
    output = _step(loss, model, calls)
    assert output.shape == (2, 8) and calls == [True, False], calls  # refused fused, run again with the logits
    _step(loss, model, calls)
    assert calls == [True, False, False] and loss.fused is False  # fusion stays off: no second refusal
    told = [record.message for record in caplog.records if "fused_loss off" in record.message]
    assert len(told) == 1 and "the model changed its head's output" in told[0], told


def test_a_fused_loss_the_user_asked_for_is_still_refused():
    loss, model = StrategyLoss(loss_parallel=True, fused=True, compile=False), _SoftCappedHead()
    with pytest.raises(HeadOutputChangedError, match="pass fused_loss=False"):
        _step(loss, model, [])
