"""OptimizerConfig.grad_norm_skip_threshold: the update is skipped (weights and state untouched) when the global
gradient norm exceeds it; the default (inf) never skips. Single process, FP32Optimizer and a chain of two."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.optimizer import ChainedOptimizer, OptimizerConfig
from megatron_core.optimizer.optimizer import FP32Optimizer


def _opt(params, **config):
    cfg = OptimizerConfig(lr=0.1, **config)
    return FP32Optimizer(torch.optim.SGD(params, lr=0.1), cfg, None)


@pytest.mark.parametrize("chained", [False, True])
@pytest.mark.parametrize("clip_grad", [0.0, 1.0])
def test_update_skipped_above_threshold(chained, clip_grad):
    w = torch.nn.Parameter(torch.ones(4))
    v = torch.nn.Parameter(torch.ones(3))
    make = (lambda **c: ChainedOptimizer([_opt([w], **c), _opt([v], **c)])) if chained \
        else (lambda **c: _opt([w, v], **c))
    assert OptimizerConfig().grad_norm_skip_threshold == math.inf
    expected_norm = math.sqrt(4 * 3.0**2 + 3 * 4.0**2)  # ~8.19

    opt = make(clip_grad=clip_grad, grad_norm_skip_threshold=5.0)
    w.grad, v.grad = torch.full((4,), 3.0), torch.full((3,), 4.0)
    ok, norm, _ = opt.step()
    assert not ok and norm == pytest.approx(expected_norm)
    assert torch.equal(w.detach(), torch.ones(4)) and torch.equal(v.detach(), torch.ones(3))

    opt = make(clip_grad=clip_grad, grad_norm_skip_threshold=10.0)
    w.grad, v.grad = torch.full((4,), 3.0), torch.full((3,), 4.0)
    ok, _, _ = opt.step()
    assert ok and not torch.equal(w.detach(), torch.ones(4))
