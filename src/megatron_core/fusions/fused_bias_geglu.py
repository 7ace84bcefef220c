"""GeGLU (``gelu_tanh(y1) * y2``) with bias and a hand-written backward, and the quick-GELU variants
(Megatron-Core's ``fused_bias_geglu``)."""

from __future__ import annotations

import torch

from megatron_core.fusions.fused_bias_gelu import bias_gelu_back
from megatron_core.jit import jit_fuser

_SQRT_2_OVER_PI = 0.79788456
_CUBIC = 0.044715


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.tanh(_SQRT_2_OVER_PI * x * (1 + _CUBIC * x * x)))


@jit_fuser
def geglu(y: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(y1) * y2`` on the halves of ``y``'s last dimension."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return _gelu_tanh(y_1) * y_2


@jit_fuser
def bias_geglu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``geglu(y + bias)``."""
    return geglu(y + bias)


@jit_fuser
def geglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`geglu` with respect to ``y``, times ``g``."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return torch.cat((bias_gelu_back(g * y_2, torch.zeros_like(y_1), y_1), g * _gelu_tanh(y_1)), -1)


@jit_fuser
def bias_geglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`bias_geglu` with respect to ``y``, times ``g``."""
    return geglu_back(g, y + bias)


class BiasGeGLUFunction(torch.autograd.Function):
    """``bias_geglu`` saving only its inputs."""

    @staticmethod
    def forward(ctx, input, bias):
        """Compute the activation, saving only the inputs."""
        ctx.save_for_backward(input, bias)
        return bias_geglu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient from the saved inputs."""
        input, bias = ctx.saved_tensors
        grad = bias_geglu_back(grad_output, input, bias)
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0)


class GeGLUFunction(torch.autograd.Function):
    """``geglu`` saving only its input."""

    @staticmethod
    def forward(ctx, input):
        """Compute the activation, saving only the inputs."""
        ctx.save_for_backward(input)
        return geglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient from the saved inputs."""
        (input,) = ctx.saved_tensors
        return geglu_back(grad_output, input)


def bias_geglu_impl(input: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """GeGLU of a 2-D or 3-D input, plus ``bias`` when given."""
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"bias_geglu_impl: input must be 2-D or 3-D, got shape {tuple(shape)}")
    flat = input.reshape(-1, shape[-1])
    out = BiasGeGLUFunction.apply(flat, bias) if bias is not None else GeGLUFunction.apply(flat)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)


@jit_fuser
def quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """Sigmoid approximation of GELU: ``y * sigmoid(1.702 y)``."""
    return y * torch.sigmoid(1.702 * y)


@jit_fuser
def quick_geglu(y: torch.Tensor, linear_offset: float = 0.0) -> torch.Tensor:
    """``quick_gelu(y1) * (y2 + linear_offset)`` on the halves of ``y``'s last dimension."""
    y_1, y_2 = torch.chunk(y, 2, dim=-1)
    return quick_gelu(y_1) * (y_2 + linear_offset)


@jit_fuser
def quick_geglu_back(g: torch.Tensor, y: torch.Tensor, linear_offset: float = 0.0) -> torch.Tensor:
    """Gradient of :func:`quick_geglu` with respect to ``y``, times ``g``."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(1.702 * y_1)
    return torch.cat((g * sig * (1 + 1.702 * y_1 * (1 - sig)) * (y_2 + linear_offset), g * y_1 * sig), -1)
