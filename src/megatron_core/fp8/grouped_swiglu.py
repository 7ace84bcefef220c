"""The experts' FP8 fc1 and their weighted SwiGLU in one autograd function, on Hopper.

In an MoE layer whose grouped experts run in FP8 (:class:`~megatron_core.fp8.grouped_layers.Float8ColumnParallelGroupedLinear`),
fc1's output ``h [rows, 2F]`` goes straight into the weighted SwiGLU ``a = silu(h1) * h2 * p`` (``p [rows, 1]`` the
routing probabilities). Kept as two autograd functions, the backward writes ``dh`` in the activation's kernel and
fc1's backward reads all of it again for its data gradient's row-wise e4m3 cast. Here fc1's forward GEMM and the
activation are one function whose backward computes ``dh`` and that cast in one kernel
(:mod:`megatron_core.fp8.weighted_swiglu_grad_cast`); the data-gradient GEMM takes the codes it wrote and the
weight gradient reads ``dh`` as before. Values, gradients and saved tensors (``x``, ``h``, ``p`` and the weight
operands) are those of the two functions, bit for bit.

:func:`fp8_grouped_gemm_weighted_swiglu` runs where the experts (``TEGroupedMLP``) call
``linear_fc1(x, counts, weighted_swiglu_probs=p)``, which they do where
:meth:`Float8ColumnParallelGroupedLinear.fuses_weighted_swiglu` says the pair qualifies; :data:`FUSED_WEIGHTED_SWIGLU`
False turns it off.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.fp8.expert_gemm_mode import forward_host_ends, per_expert_host_ends
from megatron_core.fp8.scaled_grouped_mm import (
    dgrad_gemm_from_codes,
    forward_gemm,
    group_of_rows,
    quantize_weight_rowwise,
    scaled_grouped_mm_supported,
    weight_grad,
)
from megatron_core.fp8.weighted_swiglu_grad_cast import (
    weighted_swiglu_grad_rowwise_cast,
    weighted_swiglu_grad_rowwise_cast_serves,
)
from megatron_core.fusions.fused_bias_swiglu import weighted_swiglu
from megatron_core.jit import shared_kernel_input

__all__ = ["FUSED_WEIGHTED_SWIGLU", "ScaledGroupedMmWeightedSwiGLU", "fp8_grouped_gemm_weighted_swiglu",
           "fused_weighted_swiglu_serves"]

# Whether FP8 experts run fc1 and the weighted SwiGLU as one function (False: the two functions, for comparison).
FUSED_WEIGHTED_SWIGLU = True


def fused_weighted_swiglu_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fp8_grouped_gemm_weighted_swiglu` runs for ``x [rows, in]`` and the high-precision expert weight
    ``weight [E, 2F, in]``: switched on, bf16 on a Hopper GPU with the Triton kernels present."""
    return (FUSED_WEIGHTED_SWIGLU and scaled_grouped_mm_supported(x) and weight.dim() == 3 and weight.shape[1] % 2 == 0
            and weighted_swiglu_grad_rowwise_cast_serves(x))


class ScaledGroupedMmWeightedSwiGLU(torch.autograd.Function):
    """``weighted_swiglu(cat_e(x_e @ weight[e].T), probs)`` with fc1's GEMMs in FP8 (as
    :class:`~megatron_core.fp8.scaled_grouped_mm.ScaledGroupedMm`) and the activation's gradient cast for the data
    gradient in the kernel that computes it. Arguments as ``ScaledGroupedMm``'s, plus ``probs [rows, 1]``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, probs: torch.Tensor,
                fp8_wgrad: bool = True, w_codes: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                w_codes_t: torch.Tensor | None = None, host_ends: torch.Tensor | None = None) -> torch.Tensor:
        """fc1's FP8 GEMM, then the weighted SwiGLU of its output."""
        if w_codes is None:
            w_codes, w_scale = quantize_weight_rowwise(weight)
        x = shared_kernel_input(x)  # the row-wise cast now and the column-wise one for the weight gradient
        host_ends = per_expert_host_ends(ends, host_ends)  # for the backward, and in per_expert mode the forward
        h = forward_gemm(x, w_codes, w_scale, ends, forward_host_ends(host_ends))
        ctx.save_for_backward(x, w_codes, w_scale, ends, w_codes_t, host_ends, h, probs)
        ctx.weight_dtype, ctx.fp8_wgrad = weight.dtype, fp8_wgrad
        return weighted_swiglu(h, probs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """``dh`` and ``dp`` with ``dh``'s row-wise codes in one kernel; fc1's data gradient from those codes, its
        weight gradient from ``dh``."""
        x, w_codes, w_scale, ends, w_codes_t, host_ends, h, probs = ctx.saved_tensors
        row_groups = group_of_rows(ends, h.shape[0])
        grad_h, grad_probs, dh_codes, dh_scale = weighted_swiglu_grad_rowwise_cast(grad, h, probs, w_scale,
                                                                                   row_groups)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = dgrad_gemm_from_codes(dh_codes, dh_scale, w_codes, ends, x.dtype, w_codes_t, host_ends)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad_h, x, ends, host_ends, ctx.fp8_wgrad, ctx.weight_dtype)
        return grad_x, grad_w, None, grad_probs, None, None, None, None, None


def fp8_grouped_gemm_weighted_swiglu(x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, probs: torch.Tensor,
                                     fp8_wgrad: bool = True,
                                     weight_codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                                     host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``weighted_swiglu(fp8_grouped_gemm(x, weight, ends=ends), probs)`` as one function (see the module), for
    ``x [rows, in]`` bf16 whose groups (device int32 ``ends``) start at multiples of 16 rows, ``weight [E, 2F, in]``
    and ``probs [rows, 1]``; ``fp8_wgrad``, ``weight_codes`` and ``host_ends`` as
    :func:`~megatron_core.fp8.grouped_gemm.fp8_grouped_gemm`'s.
    Callers check :func:`fused_weighted_swiglu_serves` first."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2] or probs.shape != (x.shape[0], 1):
        raise ValueError(f"fp8_grouped_gemm_weighted_swiglu: x {tuple(x.shape)}, weight {tuple(weight.shape)} and "
                         f"probs {tuple(probs.shape)} must be [N, in], [E, 2F, in] and [N, 1]")
    cached = weight_codes or (None, None, None)
    return ScaledGroupedMmWeightedSwiGLU.apply(x.contiguous(), weight, ends, probs.contiguous(), fp8_wgrad, *cached,
                                               host_ends)
