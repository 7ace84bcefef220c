"""Bias + tanh-approximated GELU with a hand-written backward (Megatron-Core's ``fused_bias_gelu``)."""

from __future__ import annotations

import torch

from megatron_core.jit import jit_fuser

_SQRT_2_OVER_PI = 0.79788456
_CUBIC = 0.044715


@jit_fuser
def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y + bias)``."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x)))


@jit_fuser
def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`bias_gelu` with respect to ``y`` (and ``bias``, before reduction) times ``g``."""
    x = bias + y
    tanh_out = torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x))
    d_inner = _SQRT_2_OVER_PI + 3 * _SQRT_2_OVER_PI * _CUBIC * x * x
    return g * (0.5 * x * (1 - tanh_out * tanh_out) * d_inner + 0.5 * (1 + tanh_out))


class GeLUFunction(torch.autograd.Function):
    """``bias_gelu`` whose backward recomputes from the saved input and bias."""

    @staticmethod
    def forward(ctx, input: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """Compute the activation, saving only the inputs."""
        ctx.save_for_backward(input, bias)
        return bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        """Gradient from the saved inputs."""
        input, bias = ctx.saved_tensors
        grad = bias_gelu_back(grad_output, bias, input)
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if bias.dim() == 1 else grad
        return grad, grad_bias


bias_gelu_impl = GeLUFunction.apply
