"""SwiGLU (``silu(y1) * y2`` on the two halves of the last dim), with bias, hand-written backward
(Megatron-Core's ``fused_bias_swiglu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_core.fusions import weighted_swiglu_triton as _triton_backward
from megatron_core.jit import jit_fuser


@jit_fuser
def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(y1) * y2`` where ``y1, y2`` are the halves of ``y``'s last dimension."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


@jit_fuser
def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``swiglu(y + bias)``."""
    return swiglu(y + bias)


@jit_fuser
def swiglu_back(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` with respect to ``y``, times ``g``."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    sig = torch.sigmoid(y_1)
    return torch.cat((g * sig * (1 + y_1 * (1 - sig)) * y_2, g * y_1 * sig), -1)


@jit_fuser
def bias_swiglu_back(g: torch.Tensor, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`bias_swiglu` with respect to ``y``, times ``g``."""
    return swiglu_back(g, y + bias)


def _input_for_backward(ctx, input: torch.Tensor, fp8_input_store: bool) -> torch.Tensor:
    ctx.ori_input_dtype = input.dtype
    ctx.fp8_input_store = fp8_input_store
    return input.to(torch.float8_e4m3fn) if fp8_input_store else input


class BiasSwiGLUFunction(torch.autograd.Function):
    """``bias_swiglu`` saving only its inputs (optionally the input in fp8)."""

    @staticmethod
    def forward(ctx, input, bias, fp8_input_store=False, cpu_offload_input=False):
        """Compute the activation, saving only the inputs."""
        ctx.save_for_backward(_input_for_backward(ctx, input, fp8_input_store), bias)
        return bias_swiglu(input, bias)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient from the saved inputs."""
        input, bias = ctx.saved_tensors
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
        grad = bias_swiglu_back(grad_output, input, bias)
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0), None, None


class SwiGLUFunction(torch.autograd.Function):
    """``swiglu`` saving only its input (optionally in fp8)."""

    @staticmethod
    def forward(ctx, input, fp8_input_store=False, cpu_offload_input=False):
        """Compute the activation, saving only the inputs."""
        ctx.save_for_backward(_input_for_backward(ctx, input, fp8_input_store))
        return swiglu(input)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradient from the saved inputs."""
        (input,) = ctx.saved_tensors
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
        return swiglu_back(grad_output, input), None, None


def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, fp8_input_store: bool = False,
                     cpu_offload_input: bool = False) -> torch.Tensor:
    """SwiGLU of a 2-D ``[tokens, 2h]`` or 3-D ``[s, b, 2h]`` input, plus ``bias`` when given."""
    shape = input.shape
    if len(shape) not in (2, 3):
        raise ValueError(f"bias_swiglu_impl: input must be 2-D or 3-D, got shape {tuple(shape)}")
    flat = input.reshape(-1, shape[-1])
    if bias is not None:
        out = BiasSwiGLUFunction.apply(flat, bias, fp8_input_store, cpu_offload_input)
    else:
        out = SwiGLUFunction.apply(flat, fp8_input_store, cpu_offload_input)
    return out if len(shape) == 2 else out.view(shape[0], shape[1], -1)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


@jit_fuser
def weighted_swiglu(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``swiglu(y) * weights`` (``weights [..., 1]``, e.g. MoE routing probabilities), in fp32, cast to ``y``'s dtype."""
    y_1, y_2 = torch.chunk(_at_least_fp32(y), 2, -1)
    return (F.silu(y_1) * y_2 * _at_least_fp32(weights)).to(y.dtype)


@jit_fuser
def weighted_swiglu_back(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`weighted_swiglu` with respect to ``y`` and ``weights``, times ``g``."""
    y_1, y_2 = torch.chunk(_at_least_fp32(y), 2, -1)
    g = _at_least_fp32(g)
    sig = torch.sigmoid(y_1)
    silu = y_1 * sig
    gw = g * _at_least_fp32(weights)
    grad_y = torch.cat((gw * sig * (1 + y_1 * (1 - sig)) * y_2, gw * silu), -1)
    grad_w = (silu * y_2 * g).sum(-1, keepdim=True)
    return grad_y.to(y.dtype), grad_w.to(weights.dtype)


class WeightedSwiGLUFunction(torch.autograd.Function):
    """``weighted_swiglu`` saving only its inputs: one fused kernel each way on an accelerator."""

    @staticmethod
    def forward(ctx, input, weights, fp8_input_store=False):
        """Compute the weighted activation, saving only the inputs."""
        ctx.save_for_backward(_input_for_backward(ctx, input, fp8_input_store), weights)
        return weighted_swiglu(input, weights)

    @staticmethod
    def backward(ctx, grad_output):
        """Gradients from the saved inputs."""
        input, weights = ctx.saved_tensors
        input = input.to(ctx.ori_input_dtype) if ctx.fp8_input_store else input
        if _triton_backward.weighted_swiglu_backward_supported(input):  # one Triton kernel for both gradients
            grad_input, grad_weights = _triton_backward.weighted_swiglu_backward(grad_output, input, weights)
        else:
            grad_input, grad_weights = weighted_swiglu_back(grad_output, input, weights)
        return grad_input, grad_weights, None


def weighted_bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor | None, weights: torch.Tensor,
                              fp8_input_store: bool = False) -> torch.Tensor:
    """``swiglu(input) * weights`` for ``input [tokens, 2h]`` and ``weights [tokens, 1]`` (no bias, as in Megatron)."""
    if bias is not None:
        raise ValueError("weighted_bias_swiglu_impl: a bias is not supported (fold it into the fc1 GEMM)")
    if input.dim() != 2 or weights.shape != (input.shape[0], 1):
        raise ValueError(f"weighted_bias_swiglu_impl: need input [tokens, 2h] and weights [tokens, 1], got "
                         f"{tuple(input.shape)} and {tuple(weights.shape)}")
    return WeightedSwiGLUFunction.apply(input, weights, fp8_input_store)
