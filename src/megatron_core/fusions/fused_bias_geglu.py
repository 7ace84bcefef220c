"""GeGLU (``gelu_tanh(y1) * y2``) with bias and a hand-written backward, and the quick-GELU variants
(Megatron-Core's ``fused_bias_geglu``), including the per-token weighted quick-GeGLU of MoE experts."""

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


@jit_fuser
def weighted_quick_geglu(y: torch.Tensor, weights: torch.Tensor, linear_offset: float | torch.Tensor = 0.0
                         ) -> torch.Tensor:
    """``quick_geglu(y, linear_offset) * weights`` (``weights [tokens, 1]``, e.g. MoE routing probabilities), in
    ``y``'s dtype."""
    return (quick_geglu(y, linear_offset) * weights).to(y.dtype)


@jit_fuser
def weighted_quick_geglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                              linear_offset: float | torch.Tensor = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_quick_geglu` with respect to ``y`` (``y``'s dtype) and ``weights`` (theirs)."""
    grad_y = quick_geglu_back(g * weights, y, linear_offset)
    grad_w = (quick_geglu(y, linear_offset) * g.to(weights.dtype)).sum(dim=-1, keepdim=True)
    return grad_y.to(y.dtype), grad_w.to(weights.dtype)


@jit_fuser
def weighted_bias_quick_geglu(y: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor,
                              linear_offset: float | torch.Tensor = 0.0) -> torch.Tensor:
    """``weighted_quick_geglu(y + bias, weights, linear_offset)``, in ``y``'s dtype."""
    return (quick_geglu(y + bias, linear_offset) * weights).to(y.dtype)


@jit_fuser
def weighted_bias_quick_geglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor,
                                   linear_offset: float | torch.Tensor = 0.0
                                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_bias_quick_geglu` with respect to ``y``, ``bias`` (per element, like ``y``; the
    caller sums it over tokens) and ``weights``."""
    grad_y, grad_w = weighted_quick_geglu_back(g, y + bias, weights, linear_offset)
    return grad_y, grad_y, grad_w


def _sum_to(grad: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``grad`` summed over the dimensions that a tensor of ``shape`` was broadcast along."""
    return grad if grad.shape == shape else grad.sum_to_size(shape)


class WeightedQuickGeGLUFunction(torch.autograd.Function):
    """``weighted_quick_geglu`` saving only its inputs (optionally the input in fp8)."""

    @staticmethod
    def forward(ctx, input, weights, fp8_input_store, linear_offset):
        """Compute the weighted activation; ``linear_offset`` is a scalar tensor."""
        stored = input.to(torch.float8_e4m3fn) if fp8_input_store else input
        ctx.save_for_backward(stored, weights, linear_offset)
        ctx.ori_input_dtype, ctx.fp8_input_store = input.dtype, fp8_input_store
        return weighted_quick_geglu(input, weights, linear_offset)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for ``input`` and ``weights``."""
        input, weights, linear_offset = ctx.saved_tensors
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
        grad_input, grad_weights = weighted_quick_geglu_back(grad_output, input, weights, linear_offset)
        return grad_input, grad_weights, None, None


class WeightedBiasQuickGeGLUFunction(torch.autograd.Function):
    """``weighted_bias_quick_geglu`` saving only its inputs (optionally the input in fp8)."""

    @staticmethod
    def forward(ctx, input, bias, weights, fp8_input_store, linear_offset):
        """Compute the weighted activation of ``input + bias``; ``linear_offset`` is a scalar tensor."""
        stored = input.to(torch.float8_e4m3fn) if fp8_input_store else input
        ctx.save_for_backward(stored, bias, weights, linear_offset)
        ctx.ori_input_dtype, ctx.fp8_input_store = input.dtype, fp8_input_store
        return weighted_bias_quick_geglu(input, bias, weights, linear_offset)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients for ``input``, ``bias`` (summed to the bias' shape) and ``weights``."""
        input, bias, weights, linear_offset = ctx.saved_tensors
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
        grad_input, grad_bias, grad_weights = weighted_bias_quick_geglu_back(
            grad_output, input, bias, weights, linear_offset)
        return grad_input, _sum_to(grad_bias, bias.shape), grad_weights, None, None


def weighted_bias_quick_geglu_impl(
    input: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor, fp8_input_store: bool = False,
    linear_offset: float = 0.0, clamp_value: float | None = None,
) -> torch.Tensor:
    """``quick_geglu(input + bias, linear_offset) * weights`` per token: the MoE experts' activation (GPT-OSS).

    ``input`` is ``[tokens, 2h]`` or ``[s, b, 2h]`` and ``weights`` one value per token (``[tokens, 1]``). With
    ``clamp_value`` ``v`` the gate half is first clamped to at most ``v`` and the linear half to ``[-v, v]``.
    """
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"weighted_bias_quick_geglu_impl: input must be 2-D or 3-D, got shape {tuple(shape)}")
    tokens = input.numel() // shape[-1]
    if weights.numel() != tokens:
        raise ValueError(f"weighted_bias_quick_geglu_impl: weights {tuple(weights.shape)} must hold one value per "
                         f"token ({tokens} tokens in input {tuple(shape)})")
    if clamp_value is not None:
        gate, linear = input.chunk(2, -1)
        input = torch.cat((gate.clamp(max=clamp_value), linear.clamp(-clamp_value, clamp_value)), -1)
    flat = input.reshape(-1, shape[-1])
    weights = weights.reshape(tokens, 1)
    offset = torch.tensor(linear_offset, dtype=flat.dtype, device=flat.device)
    if bias is not None:
        out = WeightedBiasQuickGeGLUFunction.apply(flat, bias, weights, fp8_input_store, offset)
    else:
        out = WeightedQuickGeGLUFunction.apply(flat, weights, fp8_input_store, offset)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)
