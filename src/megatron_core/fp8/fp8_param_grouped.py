"""The experts' FP8 grouped GEMM when their weight is an FP8 parameter (``fp8_param``, row-wise scales).

:func:`megatron_core.fp8.grouped_gemm.fp8_grouped_gemm` casts the experts' high-precision weight ``[E, out, in]`` to
e4m3 in every forward (one power-of-two scale per output feature of each expert) and the backward transposes those
codes. With ``fp8_param`` the weight is stored as exactly those codes and scales
(:func:`megatron_core.distributed.fp8_params.make_fp8_param` with ``scaling='rowwise'``; the distributed optimizer
writes them once per step), and the GEMM here takes them as they are:

* forward ``x_e @ W_e.T``: ``x`` cast with one scale per row, the stored codes and their dequantizing scales;
* data gradient ``dy_e @ W_e``: the stored codes (transposed on the GPU by ``transpose_codes``), their scales folded
  into ``dy`` before its row-wise cast;
* weight gradient ``dy_e.T @ x_e``: as today (one scale per column within each expert's rows), in the parameter's
  high-precision dtype, added to ``weight.main_grad`` (the DDP gradient buffer) by the backward; the weight's
  autograd gradient is a placeholder that DDP's hook ignores, as for the dense FP8 parameters
  (:mod:`megatron_core.fp8.fp8_param_linear`). With :data:`ACCUMULATE_WGRAD_IN_GEMM` the GEMM itself adds it into
  ``main_grad`` (:mod:`megatron_core.fp8.grouped_wgrad_accumulate`, a Triton kernel) instead of writing a bf16
  ``dW`` for a separate addition. With ``fp8_wgrad=False`` the weight gradient comes from the unquantized ``dy`` and
  ``x`` instead (bf16 grouped GEMM on Hopper, :func:`megatron_core.fp8.scaled_grouped_mm.hp_wgrad_gemm`; fp32 when
  emulated) and is added to ``main_grad`` the same way.

So FP8-parameter training computes what FP8 experts with a high-precision weight cast in the forward compute. On a
Hopper GPU with bf16 inputs the GEMMs are ``torch._scaled_grouped_mm`` (the casts and GEMMs of
:mod:`megatron_core.fp8.scaled_grouped_mm`); elsewhere, or with ``emulate``, the same arithmetic in fp32. Traceable
by ``torch.compile(fullgraph=True)``: the scale, ``main_grad`` and kind of placeholder gradient are read before the
autograd function, and the ``main_grad`` addition is a custom op that mutates the buffer it is given.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.fp8.expert_gemm_mode import forward_host_ends, per_expert_host_ends
from megatron_core.fp8.fp8_param_linear import _placeholder, _placeholder_kind
from megatron_core.fp8.grouped_gemm import (
    device_ends,
    emulated_grouped_wgrad,
    host_counts,
    quantize_dequantize_e4m3,
)
from megatron_core.fp8.grouped_wgrad_accumulate import (
    grouped_wgrad_accumulate_,
    grouped_wgrad_accumulate_supported,
)
from megatron_core.fp8.scaled_grouped_mm import (
    dgrad_gemm,
    forward_gemm,
    hp_wgrad_gemm,
    scaled_grouped_mm_supported,
    wgrad_gemm,
    wgrad_operands,
)
from megatron_core.jit import shared_kernel_input
from megatron_core.tensor_parallel.wgrad_accumulation import finish_fused_weight_gradient

__all__ = ["ACCUMULATE_WGRAD_IN_GEMM", "EmulatedFp8ParamGroupedGemm", "ScaledGroupedMmFp8Param",
           "fp8_param_grouped_gemm"]

# On a GPU, add the experts' weight gradient into main_grad inside the GEMM (Triton) instead of torch's grouped GEMM
# and a separate addition: the Mixtral-shaped fp8_param fwd+bwd 1.050x faster on an H200 (benchmarks/RESULTS.md,
# 2026-12-05; benchmarks/moe_fwd_bwd.py --fp8-wgrad-in-gemm). False restores the separate addition.
ACCUMULATE_WGRAD_IN_GEMM = True


@torch.library.custom_op("megatron_core::fp8_grouped_add_to_main_grad_", mutates_args=("main_grad",))
def _add_to_main_grad_op(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    main_grad.add_(grad)


@_add_to_main_grad_op.register_fake
def _(main_grad: torch.Tensor, grad: torch.Tensor) -> None:
    return None


def _accumulate(weight: torch.Tensor, main_grad: torch.Tensor | None, grad_w: torch.Tensor,
                placeholder: str) -> torch.Tensor | None:
    """Add ``grad_w`` to ``main_grad``; the placeholder autograd gradient of ``weight``."""
    if main_grad is None:
        raise RuntimeError("an FP8 expert parameter (fp8_param=True) accumulates its gradient into main_grad: wrap "
                           "the model in DistributedDataParallel with use_distributed_optimizer=True")
    if torch.compiler.is_compiling():
        torch.ops.megatron_core.fp8_grouped_add_to_main_grad_(main_grad, grad_w)
    else:
        main_grad.add_(grad_w)
    return _weight_grad_after_main_grad(weight, placeholder)


def _weight_grad_after_main_grad(weight: torch.Tensor, placeholder: str) -> torch.Tensor | None:
    """The weight's autograd gradient once its gradient is in ``main_grad``: the placeholder DDP's hook drops."""
    if torch.compiler.is_compiling():
        return _placeholder(weight, placeholder)
    return finish_fused_weight_gradient(weight)


def _save_main_grad(ctx: Any, weight: torch.Tensor, main_grad: torch.Tensor | None, placeholder: str | None) -> None:
    # main_grad is not a saved tensor: it shares the version counter of DDP's whole buffer, which other layers'
    # backward passes write before this one runs.
    ctx.main_grad = getattr(weight, "main_grad", None) if main_grad is None else main_grad
    ctx.placeholder = _placeholder_kind(weight) if placeholder is None else placeholder


class EmulatedFp8ParamGroupedGemm(torch.autograd.Function):
    """``cat_e(x_e @ W_e.T)`` for the FP8 expert parameter ``weight`` (codes ``[E, out, in]``, quantization multipliers
    ``w_scale [E * out]``), emulated in fp32 with the arithmetic of
    :class:`~megatron_core.fp8.grouped_gemm.EmulatedFp8GroupedGemm`; the weight gradient goes to ``main_grad`` in
    ``hp_dtype`` (from the unquantized ``dy`` and ``x`` with ``fp8_wgrad=False``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int], w_scale: torch.Tensor,
                hp_dtype: torch.dtype, main_grad: torch.Tensor | None = None,
                placeholder: str | None = None, fp8_wgrad: bool = True,
                w_codes_t: torch.Tensor | None = None) -> torch.Tensor:
        """The product with the stored codes; ``x`` rounded through e4m3 per row."""
        w_inverse = w_scale.detach().reciprocal().view(*weight.shape[:-1], 1)
        _save_main_grad(ctx, weight, main_grad, placeholder)
        ctx.counts, ctx.hp_dtype, ctx.fp8_wgrad = counts, hp_dtype, fp8_wgrad
        ctx.save_for_backward(x, weight, w_inverse, w_codes_t)
        w_q = weight.float() * w_inverse
        x_q = quantize_dequantize_e4m3(x, -1)
        out = [xe @ w_q[e].t() for e, xe in enumerate(torch.split(x_q, counts, dim=0))]
        return torch.cat(out, dim=0).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """Data gradient from the stored codes; weight gradient added to ``main_grad`` (placeholder returned)."""
        x, weight, w_inverse, w_codes_t = ctx.saved_tensors
        counts = ctx.counts
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # the stored codes, or their transpose cached for the step
            w_codes = weight.float() if w_codes_t is None else w_codes_t.transpose(-2, -1).float()
            grad_x = torch.cat([quantize_dequantize_e4m3(dy * w_inverse[e, :, 0], -1) @ w_codes[e]
                                for e, dy in enumerate(torch.split(grad.float(), counts, dim=0))], dim=0).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = emulated_grouped_wgrad(grad, x, counts, ctx.fp8_wgrad).to(ctx.hp_dtype)
            grad_w = _accumulate(weight, ctx.main_grad, grad_w, ctx.placeholder)
        return grad_x, grad_w, None, None, None, None, None, None, None


class ScaledGroupedMmFp8Param(torch.autograd.Function):
    """:class:`~megatron_core.fp8.scaled_grouped_mm.ScaledGroupedMm` with the weight given as e4m3 codes
    ``[E, out, in]`` and quantization multipliers ``w_scale [E * out]`` (no cast of the weight); the weight gradient
    (bf16, as the kernel writes it) is added to ``main_grad``. ``fp8_wgrad=False``: the weight gradient from the
    unquantized ``dy`` and ``x`` (torch's bf16 grouped GEMM, then the same addition). ``w_codes_t``: the codes
    transposed, cached for the step's micro-batches (else transposed in the backward). Callers check
    ``scaled_grouped_mm_supported`` first."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor, w_scale: torch.Tensor,
                main_grad: torch.Tensor | None = None, placeholder: str | None = None,
                fp8_wgrad: bool = True, w_codes_t: torch.Tensor | None = None,
                host_ends: torch.Tensor | None = None) -> torch.Tensor:
        """The forward GEMM with the stored codes and their dequantizing scales."""
        w_dequant = w_scale.detach().reciprocal().view(weight.shape[:-1])
        _save_main_grad(ctx, weight, main_grad, placeholder)
        ctx.fp8_wgrad = fp8_wgrad
        x = shared_kernel_input(x)  # the row-wise cast now and the column-wise one for the weight gradient
        host_ends = per_expert_host_ends(ends, host_ends)  # for the backward, and in per_expert mode the forward
        ctx.save_for_backward(x, weight, w_dequant, ends, w_codes_t, host_ends)
        return forward_gemm(x, weight.detach(), w_dequant, ends, forward_host_ends(host_ends))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """``dx`` from the stored codes, ``dW`` into ``main_grad``; both GEMMs in FP8 (``dW`` in bf16 without
        ``fp8_wgrad``)."""
        x, weight, w_dequant, ends, w_codes_t, host_ends = ctx.saved_tensors
        grad = shared_kernel_input(grad.contiguous())  # the data gradient's cast and the weight gradient's
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = dgrad_gemm(grad, weight.detach(), w_dequant, ends, x.dtype, w_codes_t, host_ends)
        if ctx.needs_input_grad[1]:
            main_grad = ctx.main_grad
            if not ctx.fp8_wgrad:
                grad_w = _accumulate(weight, main_grad, hp_wgrad_gemm(grad, x, ends), ctx.placeholder)
            elif (ACCUMULATE_WGRAD_IN_GEMM and grouped_wgrad_accumulate_supported(main_grad, grad)
                    and main_grad.shape == weight.shape):
                grouped_wgrad_accumulate_(main_grad, *wgrad_operands(grad, x, ends), ends)
                grad_w = _weight_grad_after_main_grad(weight, ctx.placeholder)
            else:
                grad_w = _accumulate(weight, main_grad, wgrad_gemm(grad, x, ends, host_ends), ctx.placeholder)
        return grad_x, grad_w, None, None, None, None, None, None, None


def fp8_param_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None = None,
                           ends: torch.Tensor | None = None, emulate: bool = False,
                           fp8_wgrad: bool = True, weight_t: torch.Tensor | None = None,
                           host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``cat_e(x_e @ weight[e].T)`` for an FP8 expert parameter ``weight`` (row-wise scales), differentiable, its
    gradient added to ``weight.main_grad``.

    Groups as in :func:`~megatron_core.fp8.grouped_gemm.fp8_grouped_gemm`: host ``counts`` or device int32 ``ends``;
    on a Hopper GPU with bf16 ``x`` (unless ``emulate``) every group starts at a multiple of 16 rows.
    ``fp8_wgrad=False``: the weight gradient in high precision from the unquantized ``dy`` and ``x``. ``weight_t``:
    the stored codes transposed (``[E, in, out]``), cached for a step's micro-batches
    (:mod:`megatron_core.fp8.grouped_weight_cache`); else the backward transposes them. ``host_ends``: the host copy
    of ``ends`` where the caller read it already (``per_expert`` GEMM mode).
    """
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"fp8_param_grouped_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be "
                         "[N, in] and [E, out, in]")
    if getattr(weight, "fp8_scaling", None) != "rowwise":
        raise ValueError("fp8_param_grouped_gemm needs an FP8 parameter with row-wise scales "
                         "(make_fp8_param(weight, scaling='rowwise'))")
    main_grad, placeholder = getattr(weight, "main_grad", None), _placeholder_kind(weight)
    if emulate or not scaled_grouped_mm_supported(x):
        return EmulatedFp8ParamGroupedGemm.apply(x, weight, host_counts("fp8_param_grouped_gemm", x, counts, ends),
                                                 weight.fp8_scale, weight.fp8_hp_dtype, main_grad, placeholder,
                                                 fp8_wgrad, weight_t)
    ends = device_ends("fp8_param_grouped_gemm", x, weight, counts, ends)
    return ScaledGroupedMmFp8Param.apply(x.contiguous(), weight, ends, weight.fp8_scale, main_grad, placeholder,
                                         fp8_wgrad, weight_t, host_ends)
