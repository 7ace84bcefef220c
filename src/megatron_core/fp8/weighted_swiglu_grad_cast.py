"""The experts' weighted SwiGLU backward with fc1's FP8 data-gradient cast in the same kernel (CUDA, Triton).

An FP8 expert layer's fc1 (``[rows, in] -> [rows, 2F]``) feeds ``a = silu(h1) * h2 * p`` (``p`` the routing
probability of each row). Its backward computes ``dh`` from ``da`` (:mod:`megatron_core.fusions.weighted_swiglu_triton`)
and then fc1's data-gradient GEMM casts ``dh`` row by row to e4m3, the forward's weight scales folded in
(``rowwise_cast(dh, w_scale, row_groups)``): a second pass over ``dh``, ``[rows, 2F]`` bf16, the widest tensor of the
layer. Here that kernel runs with its cast switched on (``CAST``): one program per row computes ``dh`` and ``dp``,
writes ``dh`` (the weight gradient still reads it) and takes the row's maximum of ``|dh * factor|`` on the way; then,
after a barrier, reads the row it has just written back (from L2) and writes its codes and dequantizing scale. The codes, scales, ``dh`` and ``dp``
equal those of the two kernels bit for bit: ``dh`` is rounded to its dtype before the factor multiplies it, as the
cast reads it.

:func:`weighted_swiglu_grad_rowwise_cast` runs the kernel where it serves (CUDA, Triton, ``triton_op``) and the same
arithmetic as PyTorch ops elsewhere.
"""

from __future__ import annotations

import torch

from megatron_core.fp8.scaled_grouped_mm import rowwise_cast_with_factors
from megatron_core.fusions.fused_bias_swiglu import weighted_swiglu_back
from megatron_core.fusions.weighted_swiglu_triton import launch_weighted_swiglu_backward
from megatron_core.jit import have_triton, triton_op

__all__ = ["weighted_swiglu_grad_rowwise_cast", "weighted_swiglu_grad_rowwise_cast_serves"]


def weighted_swiglu_grad_rowwise_cast_serves(y: torch.Tensor) -> bool:
    """Whether the kernel serves ``y`` (2-D, contiguous, on CUDA, Triton present)."""
    return y.is_cuda and y.dim() == 2 and y.is_contiguous() and _OP is not None and have_triton()


def _grad_cast(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor,
               row_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_y, grad_weights = torch.empty_like(y), torch.empty_like(weights)
    codes = torch.empty(y.shape, dtype=torch.float8_e4m3fn, device=y.device)
    inverse = torch.empty(y.shape[0], dtype=torch.float32, device=y.device)
    launch_weighted_swiglu_backward(g, y, weights, grad_y, grad_weights, (factors, row_groups, codes, inverse))
    return grad_y, grad_weights, codes, inverse


# Registered at import where Triton is installed (the kernel is built on its first launch).
_OP = triton_op("megatron_core::fp8_weighted_swiglu_grad_rowwise_cast", _grad_cast)


def _reference(g: torch.Tensor, y: torch.Tensor, weights: torch.Tensor, factors: torch.Tensor,
               row_groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_y, grad_weights = weighted_swiglu_back(g, y, weights)
    return grad_y, grad_weights, *rowwise_cast_with_factors(grad_y, factors, row_groups.long())


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
