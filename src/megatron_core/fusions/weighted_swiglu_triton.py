"""The backward of the weighted SwiGLU of MoE experts as one Triton kernel: the activation's and the weights' gradients.

``weighted_swiglu(y, w) = silu(y1) * y2 * w`` per row (``y [rows, 2F]``, ``w [rows, 1]``, the routing
probabilities). Its backward needs ``grad_y`` (elementwise) and ``grad_w = sum(silu(y1) * y2 * g)`` per row (a
reduction). Traced together, Inductor emits one kernel for each, both reading ``y`` and ``g``: on the
Mixtral-shaped reference (8192 rows, ``F`` 5632) 224 us + 96 us per layer on an H100. One program per row here
reads ``y`` and ``g`` once and writes both results: the bytes of the first kernel alone.

:func:`weighted_swiglu_backward_supported` says when it applies (CUDA, Triton, a torch with ``triton_op``);
elsewhere ``fused_bias_swiglu.weighted_swiglu_back`` runs. The arithmetic is that function's, in fp32; ``grad_w``
is summed in a different order. The kernel is a ``torch.library.triton_op``: a compiled graph calls it directly.
With ``CAST`` the same kernel also casts ``grad_y`` row by row to e4m3 for an FP8 layer's data gradient
(:func:`launch_weighted_swiglu_backward`, used by :mod:`megatron_core.fp8.weighted_swiglu_grad_cast`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules, triton_op

__all__ = ["launch_weighted_swiglu_backward", "weighted_swiglu_backward", "weighted_swiglu_backward_supported"]

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
    def weighted_swiglu_backward_kernel(g_ptr, y_ptr, w_ptr, dy_ptr, dw_ptr, factor_ptr, group_ptr, q_ptr, inv_ptr,
                                        F, BLOCK: tl.constexpr, CAST: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        base = row * 2 * F
        if CAST:
            fbase = tl.load(group_ptr + row).to(tl.int64) * 2 * F
        dot = tl.zeros([BLOCK], dtype=tl.float32)
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < F
            y1 = tl.load(y_ptr + base + cols, mask=live, other=0.0).to(tl.float32)
            y2 = tl.load(y_ptr + base + F + cols, mask=live, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + row * F + cols, mask=live, other=0.0).to(tl.float32)
            sig = tl.sigmoid(y1)
            silu = y1 * sig
            gw = g * w
            d1 = (gw * sig * (1 + y1 * (1 - sig)) * y2).to(dy_ptr.dtype.element_ty)
            d2 = (gw * silu).to(dy_ptr.dtype.element_ty)
            tl.store(dy_ptr + base + cols, d1, mask=live)
            tl.store(dy_ptr + base + F + cols, d2, mask=live)
            if CAST:  # the maximum of |dy * factor| over the row, dy rounded as stored
                f1 = tl.load(factor_ptr + fbase + cols, mask=live, other=0.0)
                f2 = tl.load(factor_ptr + fbase + F + cols, mask=live, other=0.0)
                amax = tl.maximum(amax, tl.maximum(tl.abs(d1.to(tl.float32) * f1), tl.abs(d2.to(tl.float32) * f2)))
            dot += silu * y2 * g
        tl.store(dw_ptr + row, tl.sum(dot, 0).to(dw_ptr.dtype.element_ty))
        if CAST:
            # 2**floor(log2(448 / amax)) from the exponent bits of the correctly rounded quotient (the rule of
            # megatron_core.fp8.cast_kernels)
            row_amax = tl.zeros([1], dtype=tl.float32) + tl.max(amax, 0)
            ratio = tl.math.div_rn(tl.zeros([1], dtype=tl.float32) + 448.0, tl.maximum(row_amax, 1e-12))
            scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
            tl.store(inv_ptr + row + tl.arange(0, 1), 1.0 / scale)
            tl.debug_barrier()  # the row's dy, written above by this program's threads, is read back below
            for start in range(0, 2 * F, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                live = cols < 2 * F
                v = tl.load(dy_ptr + base + cols, mask=live, other=0.0).to(tl.float32)
                v = v * tl.load(factor_ptr + fbase + cols, mask=live, other=0.0)
                q = tl.clamp(v * scale, -448.0, 448.0)
                tl.store(q_ptr + base + cols, q.to(tl.float8e4nv), mask=live)

    return weighted_swiglu_backward_kernel


def launch_weighted_swiglu_backward(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, grad_y: torch.Tensor,
                                    grad_weights: torch.Tensor,
                                    cast: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                                    ) -> None:
    """Write the gradients of ``weighted_swiglu(y, weights)`` given ``g`` into ``grad_y`` and ``grad_weights`` (all
    contiguous, on one CUDA device, inside a ``triton_op``). ``cast = (factors [groups, 2F] fp32, row_groups [rows]
    int32, codes [rows, 2F] e4m3, inverse [rows] fp32)``: also write ``grad_y * factors[row_groups]`` as e4m3 codes
    with one power-of-two scale per row and the dequantizing scales, in the same kernel (one row per program: the
    row is read back from L2 after it is written)."""
    if not (y.shape[0] and y.shape[1]):
        return
    factors, row_groups, codes, inverse = cast if cast is not None else (y, y, grad_y, grad_weights)  # unread
    kernel = torch.library.wrap_triton(_kernel())
    kernel[(y.shape[0],)](g, y, weights, grad_y, grad_weights, factors, row_groups, codes, inverse, y.shape[1] // 2,
                          BLOCK=_BLOCK, CAST=cast is not None, num_warps=4)


def _backward(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    grad_y = torch.empty_like(y)
    grad_weights = torch.empty_like(weights)
    launch_weighted_swiglu_backward(g, y, weights, grad_y, grad_weights)
    return grad_y, grad_weights


# Registered at import where Triton is installed (the kernel is built on its first launch).
_OP = triton_op("megatron_core::weighted_swiglu_backward", _backward)
