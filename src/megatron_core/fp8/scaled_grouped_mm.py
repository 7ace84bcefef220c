"""The experts' FP8 grouped GEMM on Hopper: ``torch._scaled_grouped_mm`` with casts ``torch.compile`` can fuse.

:func:`megatron_core.fp8.grouped_gemm.fp8_grouped_gemm` runs here on a GPU with FP8 grouped GEMMs. Every step is a
plain PyTorch op (amax, power-of-two scale, saturating cast, ``torch._scaled_grouped_mm``), so a layer compiled
with ``torch.compile`` keeps the whole expert MLP in one graph: Inductor fuses each cast with its amax and with
the transposed copy a column-major operand needs, and the group offsets stay on the device (no host sync).

The scales are those of :class:`megatron_core.fp8.grouped_gemm.EmulatedFp8GroupedGemm` (the CPU reference):
one per row of ``x`` and one per output feature of each expert's weight in the forward; the data gradient
reuses the forward's weight codes (kept for the backward, transposed once) with their scales folded into
``dy`` before its row-wise cast; the weight gradient takes one per column of ``dy`` and of ``x`` within each
expert's rows. Groups start
at multiples of :data:`ROW_ALIGN` rows (the experts' aligned layout), so the per-expert column maxima are taken
over blocks of 16 rows and then over each expert's blocks, without a host-known row count.

With ``fp8_wgrad=False`` the weight gradient is torch's bf16 grouped GEMM ``torch._grouped_mm(dy.T, x, offs=ends)``
on the unquantized operands (:func:`hp_wgrad_gemm`; the groups split the contraction dimension, the tokens).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.distributed.fp8_params import power_of_two_scale
from megatron_core.fp8.cast_kernels import (
    fp8_cast_kernels_available,
    group_columnwise_cast_transposed,
    rowwise_cast,
    transpose_codes,
)
from megatron_core.fp8.expert_gemm_mode import (
    forward_host_ends,
    per_expert_host_ends,
    per_expert_mm,
    per_expert_wgrad_mm,
)
from megatron_core.jit import shared_kernel_input

__all__ = ["ROW_ALIGN", "WGRAD_K_ALIGN", "ScaledGroupedMm", "aligned_contraction_layout", "dgrad_gemm_from_codes",
           "group_of_rows", "hp_wgrad_gemm", "scales_after_gemm",
           "power_of_two_scale", "rowwise_cast_with_factors", "scaled_grouped_mm_supported", "transposed_weight_codes",
           "weight_grad"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)
AMAX_EPS = 1e-12
ROW_ALIGN = 16
# The per-expert weight-gradient GEMMs' contraction (each expert's tokens) padded with zero columns to a multiple of
# this: cuBLAS's row-wise-scaled FP8 kernels ran those GEMMs 15-18% faster with a contraction of whole 128-token
# blocks (H100, Mixtral 8x7B's shapes, benchmarks/RESULTS.md session 53).
WGRAD_K_ALIGN = 128
_KERNEL = getattr(torch, "_scaled_grouped_mm", None)
_GROUPED_MM = getattr(torch, "_grouped_mm", None)


def scaled_grouped_mm_supported(x: torch.Tensor) -> bool:
    """Whether the FP8 grouped-GEMM kernel serves ``x``: bf16 on a Hopper GPU (compute capability 9.x)."""
    return (_KERNEL is not None and x.is_cuda and x.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] == 9)


def _cast(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t.float() * scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def _rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` as e4m3 codes with one scale per slice along the last dimension, and the dequantizing scales."""
    scale = power_of_two_scale(t.abs().amax(-1, keepdim=True))
    return _cast(t, scale), scale.reciprocal().squeeze(-1)


def group_of_rows(ends: torch.Tensor, rows: int, step: int = 1) -> torch.Tensor:
    """The group of rows ``0, step, 2 step, ..`` for groups ending at ``ends`` (the last ending at ``rows``)."""
    starts = torch.arange(0, rows, step, device=ends.device, dtype=ends.dtype)
    return torch.searchsorted(ends, starts, right=True).clamp(max=ends.numel() - 1)


def _group_columnwise_transposed(t: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, C]`` quantized with one scale per column within each group of rows, returned transposed
    (``[C, M]``, row-major) with the dequantizing scales ``[groups * C]`` (group-major), as the kernel's 2D x 2D
    form takes them."""
    rows, cols = t.shape
    blocks = t.view(rows // ROW_ALIGN, ROW_ALIGN, cols).abs().amax(1).float()
    group_of_block = group_of_rows(ends, rows, ROW_ALIGN)
    groups = torch.arange(ends.numel(), device=t.device, dtype=group_of_block.dtype)
    in_group = (group_of_block[None, :] == groups[:, None])[:, :, None]
    amax = torch.where(in_group, blocks[None], 0.0).amax(1)  # [groups, C]; few groups: a masked max each
    scale = power_of_two_scale(amax)
    codes = _cast(t.view(rows // ROW_ALIGN, ROW_ALIGN, cols), scale[group_of_block][:, None, :])
    return codes.view(rows, cols).t().contiguous(), scale.reciprocal().reshape(-1)


def scales_after_gemm(contraction: int, columns: int) -> bool:
    """Whether a per-expert GEMM runs as cuBLAS's tensorwise kernels (unit scales) with its row and column scales
    multiplied into the product afterwards (by plain ops that ``torch.compile`` fuses into the product's consumer),
    instead of cuBLAS's row-wise-scaled kernels: where the contraction is at least twice the output's columns (fc2's
    forward, fc1's data gradient), which the row-wise kernels run 10-25% slower (Mixtral 8x7B's shapes on an H100,
    ``benchmarks/fp8_expert_gemm_shapes.py``, benchmarks/RESULTS.md session 53), and the output is small beside the
    GEMM's work. The scales are powers of two, so the product is the same."""
    return contraction >= 2 * columns


def _expert_gemm(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor | None,
                 ends: torch.Tensor, out_dtype: torch.dtype, host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``cat_e(a_e @ b[e])`` (``a [M, K]`` row-wise scaled, ``b [E, K, N]`` column-major per expert, scaled per
    column of each expert by ``b_scale [E, N]``, ``None``: ones): one GEMM per expert sized by ``host_ends`` (the
    host copy of ``ends`` that ``per_expert`` mode makes once per layer,
    :func:`~megatron_core.fp8.expert_gemm_mode.per_expert_host_ends`; see :func:`scales_after_gemm`), else one
    grouped GEMM."""
    if host_ends is not None and scales_after_gemm(a.shape[1], b.shape[2]):
        product = per_expert_mm(a, None, b, None, host_ends, out_dtype).float()
        if b_scale is not None:
            product = product * b_scale[group_of_rows(ends, a.shape[0])]
        return (product * a_scale[:, None]).to(out_dtype)
    if host_ends is not None:
        return per_expert_mm(a, a_scale, b, b_scale, host_ends, out_dtype)
    if b_scale is None:
        b_scale = a_scale.new_ones(b.shape[0], b.shape[2])
    return _KERNEL(a, b, a_scale, b_scale, offs=ends, out_dtype=out_dtype, use_fast_accum=True)


def quantize_weight_rowwise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert weight ``[E, out, in]`` as e4m3 codes with one power-of-two scale per output feature of each expert,
    and the dequantizing scales ``[E, out]`` (what an FP8 parameter with row-wise scales stores)."""
    if fp8_cast_kernels_available(weight) and weight.is_contiguous():
        w_codes, w_scale = rowwise_cast(weight.view(-1, weight.shape[-1]))
        return w_codes.view(weight.shape), w_scale.view(weight.shape[:-1])
    return _rowwise(weight)


def forward_gemm(x: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, ends: torch.Tensor,
                 host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``cat_e(x_e @ W_e.T)``: ``x`` cast with one scale per row, against the given weight codes ``[E, out, in]`` and
    dequantizing scales ``[E, out]`` (``host_ends``: see :func:`_expert_gemm`)."""
    if fp8_cast_kernels_available(x):
        x_codes, x_scale = rowwise_cast(x)
    else:
        x_codes, x_scale = _rowwise(x)
    return _expert_gemm(x_codes, w_codes.transpose(-2, -1), x_scale, w_scale, ends, x.dtype, host_ends)


def transposed_weight_codes(w_codes: torch.Tensor) -> torch.Tensor:
    """The weight codes ``[E, out, in]`` as ``[E, in, out]`` contiguous: the data gradient's operand."""
    if fp8_cast_kernels_available(w_codes):
        return transpose_codes(w_codes)
    return w_codes.transpose(-2, -1).contiguous()


def dgrad_gemm(grad: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, ends: torch.Tensor,
               out_dtype: torch.dtype, w_codes_t: torch.Tensor | None = None,
               host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``dx = cat_e(dy_e @ W_e)`` from the forward's weight codes (transposed here unless ``w_codes_t``, their
    transpose cached across micro-batches, is given), their scales folded into ``dy`` before its row-wise cast
    (``host_ends``: see :func:`_expert_gemm`)."""
    dy_codes, dy_scale = rowwise_cast_with_factors(grad, w_scale, group_of_rows(ends, grad.shape[0]))
    return dgrad_gemm_from_codes(dy_codes, dy_scale, w_codes, ends, out_dtype, w_codes_t, host_ends)


def rowwise_cast_with_factors(t: torch.Tensor, factors: torch.Tensor, row_groups: torch.Tensor
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t * factors[row_groups]`` (``factors [groups, K]``, one row per group) as e4m3 codes with one power-of-two
    scale per row, and the dequantizing scales ``[M]``: the Triton cast where it serves, else the formula."""
    if fp8_cast_kernels_available(t):
        return rowwise_cast(t, factors, row_groups)
    return _rowwise(t.float() * factors[row_groups])


def dgrad_gemm_from_codes(dy_codes: torch.Tensor, dy_scale: torch.Tensor, w_codes: torch.Tensor, ends: torch.Tensor,
                          out_dtype: torch.dtype, w_codes_t: torch.Tensor | None = None,
                          host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`dgrad_gemm` from ``dy`` already cast: its e4m3 codes ``[M, out]`` (the weight scales folded in) and
    their dequantizing scales ``[M]``."""
    if w_codes_t is None:
        w_codes_t = transposed_weight_codes(w_codes)
    return _expert_gemm(dy_codes, w_codes_t.transpose(-2, -1), dy_scale, None, ends, out_dtype, host_ends)


def aligned_contraction_layout(ends: torch.Tensor, rows: int, align: int
                               ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The weight gradient's contraction (the tokens of groups of rows ending at ``ends``, the last at ``rows``)
    with every group padded with zero columns to a multiple of ``align``: ``(source_rows [L], column_groups [L],
    L)``, column ``j`` holding row ``source_rows[j]`` (-1: a zero column) of group ``column_groups[j]``. ``L`` is
    static (``rows`` plus the most padding any routing needs, rounded to 16); the groups' padded lengths, which
    consumers work out on the host, are ``ceil(count / align) * align``."""
    groups = ends.numel()
    ends = ends.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    padded = (ends - starts + align - 1) // align * align
    padded_ends = padded.cumsum(0)
    length = -(-(rows + groups * (align - 1)) // ROW_ALIGN) * ROW_ALIGN
    column = torch.arange(length, device=ends.device)
    group = torch.searchsorted(padded_ends, column, right=True).clamp(max=groups - 1)
    source = column - (padded_ends - padded)[group] + starts[group]
    return torch.where(source < ends[group], source, -1).to(torch.int32), group.to(torch.int32), length


def _placed(codes_t: torch.Tensor, source_rows: torch.Tensor) -> torch.Tensor:
    """The transposed codes ``[C, M]`` with their columns placed as ``source_rows`` says (-1: zeros)."""
    columns = codes_t.view(torch.uint8).index_select(1, source_rows.clamp(min=0))
    return torch.where(source_rows >= 0, columns, 0).view(codes_t.dtype)


def wgrad_operands(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, k_align: int = 1
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight gradient's operands: ``dy`` and ``x`` cast with one scale per column within each expert's rows,
    transposed: ``(dyt_codes [out, L], xt_codes [in, L], dyt_scale [E * out], xt_scale [E * in])``, ``L = M`` or,
    with ``k_align`` > 1, each expert's columns padded with zeros to a multiple of it
    (:func:`aligned_contraction_layout`)."""
    rows = grad.shape[0]
    layout = None if k_align == 1 else aligned_contraction_layout(ends, rows, k_align)[:2]
    if fp8_cast_kernels_available(grad) and x.is_contiguous():
        if layout is None:  # the rows in place, made once for both operands
            layout = (torch.arange(rows, device=grad.device, dtype=torch.int32), group_of_rows(ends, rows))
        dyt_codes, dyt_scale = group_columnwise_cast_transposed(grad, ends, None, layout)
        xt_codes, xt_scale = group_columnwise_cast_transposed(x, ends, None, layout)
        return dyt_codes, xt_codes, dyt_scale, xt_scale
    dyt_codes, dyt_scale = _group_columnwise_transposed(grad, ends)
    xt_codes, xt_scale = _group_columnwise_transposed(x, ends)
    if layout is not None:
        dyt_codes, xt_codes = _placed(dyt_codes, layout[0]), _placed(xt_codes, layout[0])
    return dyt_codes, xt_codes, dyt_scale, xt_scale


def wgrad_gemm(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor,
               host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``dW_e = dy_e.T @ x_e`` (``[E, out, in]`` in ``x``'s dtype) from :func:`wgrad_operands`: one GEMM per expert
    where ``host_ends`` is given (see :func:`_expert_gemm`; each expert's contraction padded to
    :data:`WGRAD_K_ALIGN`), else one grouped GEMM."""
    if host_ends is not None:
        dyt_codes, xt_codes, dyt_scale, xt_scale = wgrad_operands(grad, x, ends, WGRAD_K_ALIGN)
        return per_expert_wgrad_mm(dyt_codes, dyt_scale, xt_codes, xt_scale, host_ends, x.dtype, WGRAD_K_ALIGN)
    dyt_codes, xt_codes, dyt_scale, xt_scale = wgrad_operands(grad, x, ends)
    return _KERNEL(dyt_codes, xt_codes.t(), dyt_scale, xt_scale, offs=ends, out_dtype=x.dtype, use_fast_accum=True)


def hp_wgrad_gemm(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``dW_e = dy_e.T @ x_e`` (``[E, out, in]``, bf16) from the unquantized contiguous ``dy [M, out]`` and
    ``x [M, in]`` (``fp8_wgrad=False``): one bf16 grouped GEMM whose groups split the tokens (``dy.T`` enters
    column-major, as PyTorch's own backward of ``torch._grouped_mm`` passes it); an expert without tokens gets
    zeros."""
    if x.shape[0] == 0:  # no tokens for any expert: an empty contraction, nothing to multiply
        return x.new_zeros(ends.numel(), grad.shape[1], x.shape[1])
    return _GROUPED_MM(grad.t(), x, offs=ends)


def weight_grad(grad: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, host_ends: torch.Tensor | None,
                fp8_wgrad: bool, dtype: torch.dtype) -> torch.Tensor:
    """``dW_e = dy_e.T @ x_e`` in ``dtype``: :func:`wgrad_gemm` (FP8), or :func:`hp_wgrad_gemm` without ``fp8_wgrad``."""
    return (wgrad_gemm(grad, x, ends, host_ends) if fp8_wgrad else hp_wgrad_gemm(grad, x, ends)).to(dtype)


class ScaledGroupedMm(torch.autograd.Function):
    """``cat_e(x_e @ weight[e].T)`` with e4m3 operands on Hopper; forward, data and weight gradient in FP8 (the
    weight gradient in bf16 from the unquantized operands with ``fp8_wgrad=False``, see :func:`hp_wgrad_gemm`).

    ``x [M, in]`` (bf16, ``M`` a multiple of 16), ``weight [E, out, in]``, ``ends [E]`` int32 group end offsets
    (each a multiple of 16, the last ``M``). ``w_codes``, ``w_scale``, ``w_codes_t``: the weight's codes, their
    dequantizing scales ``[E, out]`` and transposed codes ``[E, in, out]`` made beforehand (cached across a step's
    micro-batches, :mod:`megatron_core.fp8.grouped_weight_cache`); without them the weight is cast here and its
    codes transposed in the backward. ``host_ends``: the host copy of ``ends`` where the caller read it already
    (``per_expert`` mode). Callers check :func:`scaled_grouped_mm_supported` first.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor,
                fp8_wgrad: bool = True, w_codes: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                w_codes_t: torch.Tensor | None = None, host_ends: torch.Tensor | None = None) -> torch.Tensor:
        """The forward GEMM: rows of ``x`` and each expert's output features scaled separately."""
        if w_codes is None:
            w_codes, w_scale = quantize_weight_rowwise(weight)
        x = shared_kernel_input(x)  # the row-wise cast now and the column-wise one for the weight gradient
        host_ends = per_expert_host_ends(ends, host_ends)  # for the backward, and in per_expert mode the forward
        ctx.save_for_backward(x, w_codes, w_scale, ends, w_codes_t, host_ends)
        ctx.weight_dtype, ctx.fp8_wgrad = weight.dtype, fp8_wgrad
        return forward_gemm(x, w_codes, w_scale, ends, forward_host_ends(host_ends))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """``dx = dy_e @ W_e`` (the forward's weight codes, their scales folded into ``dy``) and
        ``dW_e = dy_e.T @ x_e``, both in FP8 unless ``fp8_wgrad=False``."""
        x, w_codes, w_scale, ends, w_codes_t, host_ends = ctx.saved_tensors
        grad = shared_kernel_input(grad.contiguous())  # the data gradient's cast and the weight gradient's
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = dgrad_gemm(grad, w_codes, w_scale, ends, x.dtype, w_codes_t, host_ends)
        if ctx.needs_input_grad[1]:
            grad_w = weight_grad(grad, x, ends, host_ends, ctx.fp8_wgrad, ctx.weight_dtype)
        return grad_x, grad_w, None, None, None, None, None, None
