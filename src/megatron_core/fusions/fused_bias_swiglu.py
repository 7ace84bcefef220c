"""SwiGLU (``silu(y1) * y2`` on the two halves of the last dim), with bias, hand-written backward
(Megatron-Core's ``fused_bias_swiglu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
