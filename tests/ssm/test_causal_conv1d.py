"""The accelerator form of the causal depthwise convolution (shifted multiply-adds) equals ``F.conv1d`` on CPU."""

from __future__ import annotations

import torch

from megatron_core.ssm.causal_conv1d import _shifted_conv_silu, causal_conv1d_silu


def test_shifted_sum_matches_conv1d_with_gradients() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 11, 6, generator=gen, dtype=torch.float64).requires_grad_()
    weight = torch.randn(6, 1, 4, generator=gen, dtype=torch.float64).requires_grad_()
    bias = torch.randn(6, generator=gen, dtype=torch.float64).requires_grad_()
    want = causal_conv1d_silu(x, weight, bias)
    got = _shifted_conv_silu.__wrapped_eager__(x, weight, bias)
    torch.testing.assert_close(got, want)
    dy = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (x, weight, bias), dy)
    got_grads = torch.autograd.grad(got, (x, weight, bias), dy)
    for got_grad, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got_grad, want_grad)
