"""The backward of the weighted SwiGLU of MoE experts as one Triton kernel: the activation's and the weights' gradients.

``weighted_swiglu(y, w) = silu(y1) * y2 * w`` per row (``y [rows, 2F]``, ``w [rows, 1]``, the routing
probabilities). Its backward needs ``grad_y`` (elementwise) and ``grad_w = sum(silu(y1) * y2 * g)`` per row (a
reduction). Traced together, Inductor emits one kernel for each, both reading ``y`` and ``g``: on the
Mixtral-shaped reference (8192 rows, ``F`` 5632) 224 us + 96 us per layer on an H100. One program per row here
reads ``y`` and ``g`` once and writes both results: the bytes of the first kernel alone.

:func:`weighted_swiglu_backward_supported` says when it applies (CUDA, Triton, a torch with ``triton_op``);
elsewhere ``fused_bias_swiglu.weighted_swiglu_back`` runs. The arithmetic is that function's, in fp32; ``grad_w``
is summed in a different order. The kernel is a ``torch.library.triton_op``: a compiled graph calls it directly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules, triton_op

__all__ = ["weighted_swiglu_backward", "weighted_swiglu_backward_supported"]

_BLOCK = 512  # columns per step of a row's loop; the reference's F = 5632 is 11 of them


def weighted_swiglu_backward_supported(y: torch.Tensor) -> bool:
    """Whether :func:`weighted_swiglu_backward` serves ``y`` (2-D, CUDA, Triton installed)."""
    return y.is_cuda and y.dim() == 2 and y.shape[1] % 2 == 0 and _OP is not None and have_triton()


def weighted_swiglu_backward(
    grad_output: torch.Tensor, y: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_y [rows, 2F] in y's dtype, grad_weights [rows, 1] in weights' dtype)`` for ``grad_output [rows, F]``."""
    rows, width = y.shape
    if grad_output.shape != (rows, width // 2) or weights.shape != (rows, 1):
        raise ValueError(
            f"weighted_swiglu_backward: need grad_output [rows, F], y [rows, 2F] and weights [rows, 1]; got "
            f"{tuple(grad_output.shape)}, {tuple(y.shape)} and {tuple(weights.shape)}"
        )
    if _OP is None:
        raise RuntimeError("weighted_swiglu_backward needs Triton and a torch with torch.library.triton_op "
                           "(weighted_swiglu_backward_supported says when it runs)")
    return _OP(grad_output.contiguous(), y.contiguous(), weights.contiguous())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def weighted_swiglu_backward_kernel(g_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < F
            y1 = tl.load(y_ptr + row * 2 * F + cols, mask=live, other=0.0).to(tl.float32)
            y2 = tl.load(y_ptr + row * 2 * F + F + cols, mask=live, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * F + cols, mask=live, other=0.0).to(tl.float32)
            sig = tl.sigmoid(y1)
            silu = y1 * sig
            gw = g * w
            tl.store(dy_ptr + row * 2 * F + cols, (gw * sig * (1 + y1 * (1 - sig)) * y2).to(dy_ptr.dtype.element_ty),
                     mask=live)
            tl.store(dy_ptr + row * 2 * F + F + cols, (gw * silu).to(dy_ptr.dtype.element_ty), mask=live)
            dot += silu * y2 * g
        tl.store(dw_ptr + row, tl.sum(dot, 0).to(dw_ptr.dtype.element_ty))

    return weighted_swiglu_backward_kernel


def _backward(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_y = torch.empty_like(y)
    grad_weights = torch.empty_like(weights)
    if y.shape[0] and y.shape[1]:
        kernel = torch.library.wrap_triton(_kernel())
        kernel[(y.shape[0],)](g, y, weights, grad_y, grad_weights, y.shape[1] // 2, BLOCK=_BLOCK, num_warps=4)
    return grad_y, grad_weights


# Registered at import where Triton is installed (the kernel is built on its first launch).
_OP = triton_op("megatron_core::weighted_swiglu_backward", _backward)
