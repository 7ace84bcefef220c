"""The experts' weighted SwiGLU backward with fc1's FP8 data-gradient cast in the same kernel (CUDA, Triton).

An FP8 expert layer's fc1 (``[rows, in] -> [rows, 2F]``) feeds ``a = silu(h1) * h2 * p`` (``p`` the routing
probability of each row). Its backward computes ``dh`` from ``da`` (:mod:`megatron_core.fusions.weighted_swiglu_triton`)
and then fc1's data-gradient GEMM casts ``dh`` row by row to e4m3, the forward's weight scales folded in
(``rowwise_cast(dh, w_scale, row_groups)``): a second pass over ``dh``, ``[rows, 2F]`` bf16, the widest tensor of the
layer. Here one program per row computes ``dh`` and ``dp`` as that kernel does, writes ``dh`` (the weight gradient
still reads it) and takes the row's maximum of ``|dh * factor|`` on the way; then, after a barrier, reads the row it
has just written back (from L2) and writes its codes and dequantizing scale. The codes, scales, ``dh`` and ``dp``
equal those of the two kernels bit for bit: ``dh`` is rounded to its dtype before the factor multiplies it, as the
cast reads it.

:func:`weighted_swiglu_grad_rowwise_cast` runs the kernel where it serves (CUDA, Triton, ``triton_op``) and the same
arithmetic as PyTorch ops elsewhere.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules, triton_op

__all__ = ["weighted_swiglu_grad_rowwise_cast", "weighted_swiglu_grad_rowwise_cast_serves"]

_BLOCK = 512  # columns per step of a row's loops: the same steps (and so the same sum order for dp) as the
# backward kernel of megatron_core.fusions.weighted_swiglu_triton
E4M3_MAX = 448.0


def weighted_swiglu_grad_rowwise_cast_serves(y: torch.Tensor) -> bool:
    """Whether the kernel serves ``y`` (2-D, contiguous, on CUDA, Triton present)."""
    return y.is_cuda and y.dim() == 2 and y.is_contiguous() and _OP is not None and have_triton()


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def weighted_swiglu_grad_cast_kernel(g_ptr, y_ptr, w_ptr, factor_ptr, group_ptr, dy_ptr, dw_ptr, q_ptr, inv_ptr,
                                         F, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        fbase = tl.load(group_ptr + row).to(tl.int64) * 2 * F
        base = row * 2 * F
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
            f1 = tl.load(factor_ptr + fbase + cols, mask=live, other=0.0)
            f2 = tl.load(factor_ptr + fbase + F + cols, mask=live, other=0.0)
            amax = tl.maximum(amax, tl.maximum(tl.abs(d1.to(tl.float32) * f1), tl.abs(d2.to(tl.float32) * f2)))
            dot += silu * y2 * g
        tl.store(dw_ptr + row, tl.sum(dot, 0).to(dw_ptr.dtype.element_ty))
        # 2**floor(log2(448 / amax)) from the exponent bits of the correctly rounded quotient (cast_kernels' rule)
        row_amax = tl.zeros([1], dtype=tl.float32) + tl.max(amax, 0)
        ratio = tl.math.div_rn(tl.zeros([1], dtype=tl.float32) + 448.0, tl.maximum(row_amax, 1e-12))
        scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        tl.store(inv_ptr + row + tl.arange(0, 1), 1.0 / scale)
        tl.debug_barrier()  # the row's dh, written above by this program's threads, is read back below
        for start in range(0, 2 * F, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            live = cols < 2 * F
            v = tl.load(dy_ptr + base + cols, mask=live, other=0.0).to(tl.float32)
            v = v * tl.load(factor_ptr + fbase + cols, mask=live, other=0.0)
            q = tl.clamp(v * scale, -448.0, 448.0)
            tl.store(q_ptr + base + cols, q.to(tl.float8e4nv), mask=live)

    return weighted_swiglu_grad_cast_kernel


def _grad_cast(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor,
               row_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, width = y.shape
    grad_y = torch.empty_like(y)
    grad_weights = torch.empty_like(weights)
    codes = torch.empty(rows, width, dtype=torch.float8_e4m3fn, device=y.device)
    inverse = torch.empty(rows, dtype=torch.float32, device=y.device)
    if rows and width:
        kernel = torch.library.wrap_triton(_kernel())
        kernel[(rows,)](g, y, weights, factors, row_groups, grad_y, grad_weights, codes, inverse, width // 2,
                        BLOCK=_BLOCK, num_warps=4)
    return grad_y, grad_weights, codes, inverse


# Registered at import where Triton is installed (the kernel is built on its first launch).
_OP = triton_op("megatron_core::fp8_weighted_swiglu_grad_rowwise_cast", _grad_cast)


def _reference(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor,
               row_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from megatron_core.distributed.fp8_params import power_of_two_scale
    from megatron_core.fusions.fused_bias_swiglu import weighted_swiglu_back

    grad_y, grad_weights = weighted_swiglu_back(g, y, weights)
    v = grad_y.float() * factors[row_groups.long()]
    scale = power_of_two_scale(v.abs().amax(-1, keepdim=True))
    codes = (v * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return grad_y, grad_weights, codes, scale.reciprocal().squeeze(-1)


def weighted_swiglu_grad_rowwise_cast(grad_output: torch.Tensor, y: torch.Tensor, weights: torch.Tensor,
                                      factors: torch.Tensor, row_groups: torch.Tensor
                                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dy, dw, codes, inverse)`` for the weighted SwiGLU ``silu(y1) * y2 * w`` of ``y [rows, 2F]`` and
    ``weights [rows, 1]`` given ``grad_output [rows, F]``: ``dy [rows, 2F]`` in ``y``'s dtype and ``dw [rows, 1]`` in
    ``weights``' dtype (its gradients), and ``dy * factors[row_groups]`` (``factors [groups, 2F]`` fp32,
    ``row_groups [rows]`` int) as e4m3 codes with one power-of-two scale per row and the dequantizing scales
    ``[rows]`` fp32 (what ``cast_kernels.rowwise_cast(dy, factors, row_groups)`` gives)."""
    rows, width = y.shape
    if (grad_output.shape != (rows, width // 2) or weights.shape != (rows, 1) or width % 2
            or factors.dim() != 2 or factors.shape[1] != width or row_groups.shape != (rows,)):
        raise ValueError(
            "weighted_swiglu_grad_rowwise_cast: need grad_output [rows, F], y [rows, 2F], weights [rows, 1], "
            f"factors [groups, 2F] and row_groups [rows]; got {tuple(grad_output.shape)}, {tuple(y.shape)}, "
            f"{tuple(weights.shape)}, {tuple(factors.shape)} and {tuple(row_groups.shape)}")
    factors = factors.float().contiguous()
    if weighted_swiglu_grad_rowwise_cast_serves(y):
        return _OP(grad_output.contiguous(), y, weights.contiguous(), factors, row_groups.to(torch.int32))
    return _reference(grad_output, y, weights, factors, row_groups)
