"""Clipping folded into torch's fused Adam equals clip-then-step, and an inf gradient skips the update."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_core.optimizer import OptimizerConfig
from megatron_core.optimizer.fused_clip import supports_fused_clipping
from megatron_core.optimizer.optimizer import FP32Optimizer


def _run(fused: bool, grads: list[float], clip: float = 0.5, losses: list[float] | None = None):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    for p in model.parameters():
        p.main_grad = torch.zeros_like(p)  # as DDP leaves them
    inner = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, **({"fused": True} if fused
                                                                                else {"foreach": True}))
    opt = FP32Optimizer(inner, OptimizerConfig(lr=0.1, clip_grad=clip, weight_decay=0.1))
    assert supports_fused_clipping(inner) is fused
    results = []
    for step, scale in enumerate(grads):
        for i, p in enumerate(model.parameters()):
            p.main_grad.copy_(torch.full_like(p, scale * (i + 1)) + torch.arange(p.numel()).view_as(p) * 0.01)
        if losses is None:
            results.append(opt.step())
        else:
            results.append(opt.step(skip_unless_finite=torch.tensor(losses[step], dtype=torch.float64)))
    return model, inner, results


@pytest.mark.parametrize("grads", [[3.0, 0.01, 2.0], [1.0, math.inf, 1.0]])
def test_fused_clip_equals_clip_then_step(grads):
    try:
        fused_model, fused_inner, fused_res = _run(True, grads)
    except RuntimeError as err:  # a torch build without the CPU fused kernel
        pytest.skip(f"fused AdamW unavailable on CPU: {err}")
    ref_model, ref_inner, ref_res = _run(False, grads)
    for (ok_f, norm_f, _), (ok_r, norm_r, _) in zip(fused_res, ref_res):
        assert ok_f == ok_r
        assert (math.isfinite(norm_f) and math.isclose(norm_f, norm_r, rel_tol=1e-6)) or (
            not math.isfinite(norm_f) and not math.isfinite(norm_r))
    for pf, pr in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(pf, pr, rtol=1e-6, atol=1e-6)
        sf, sr = fused_inner.state[pf], ref_inner.state[pr]
        torch.testing.assert_close(sf["exp_avg"], sr["exp_avg"], rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(sf["exp_avg_sq"], sr["exp_avg_sq"], rtol=1e-6, atol=1e-9)
        assert float(sf["step"]) == float(sr["step"]) == sum(math.isfinite(g) for g in grads)


@pytest.mark.parametrize("fused", [True, False])
def test_a_non_finite_loss_skips_the_step_with_finite_gradients(fused):
    grads, losses = [3.0, 2.0, 1.0], [2.5, math.nan, 2.0]
    try:
        model, inner, results = _run(fused, grads, losses=losses)
    except RuntimeError as err:  # a torch build without the CPU fused kernel
        pytest.skip(f"fused AdamW unavailable on CPU: {err}")
    assert [ok for ok, _, _ in results] == [True, False, True]
    assert all(math.isfinite(norm) for _, norm, _ in results)  # the norm is reported as computed
    skipped_model, skipped_inner, _ = _run(fused, [grads[0], grads[2]])  # the same run without the skipped step
    for p, q in zip(model.parameters(), skipped_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        assert float(inner.state[p]["step"]) == float(skipped_inner.state[q]["step"]) == 2
