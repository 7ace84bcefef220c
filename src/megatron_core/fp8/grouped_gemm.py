"""FP8 grouped GEMM of the MoE experts: e4m3 operands with row-wise scales, forward and backward.

Megatron-Core runs its grouped experts in FP8 through Transformer Engine's ``GroupedLinear``; here the
experts' grouped GEMM ``cat_e(x_e @ W_e.T)`` (:func:`megatron_core.transformer.moe.grouped_linear.grouped_gemm`)
is quantized with one scale per row or column of each operand, the only FP8 grouped recipe Hopper's
``torch._scaled_grouped_mm`` offers:

=========  ======================  ==========================================================
GEMM       operands                one scale per
=========  ======================  ==========================================================
forward    ``x_e @ W_e.T``         row of ``x``; output feature of ``W_e`` (over ``in``)
dgrad      ``dy_e @ W_e``          row of ``dy * s_e`` (``s_e``: the forward's weight scales), the
                                   forward's codes of ``W_e``
wgrad      ``dy_e.T @ x_e``        column of ``dy_e`` and of ``x_e``, within each expert's rows
=========  ======================  ==========================================================

With ``fp8_wgrad=False`` (Megatron-Core's ``TransformerConfig.fp8_wgrad``, which Transformer Engine's recipe turns
into a high-precision weight-gradient GEMM) the wgrad row is not quantized: ``dW_e = dy_e.T @ x_e`` from the
unquantized ``dy`` and ``x`` (the forward keeps ``x`` as it came), in bf16 on Hopper and in fp32 when emulated;
the forward and data-gradient GEMMs stay FP8.

Scales are powers of two (``2**floor(log2(448 / amax))``), so quantization only rounds the mantissa.
On a Hopper GPU with bf16 inputs the work is done by :class:`megatron_core.fp8.scaled_grouped_mm.ScaledGroupedMm`
(``torch._scaled_grouped_mm`` with casts written as plain PyTorch ops, so ``torch.compile`` keeps the experts in
one graph); each expert's rows must start at a multiple of 16, which the experts' aligned layout provides.
Elsewhere (a CPU, another GPU, fp32/fp16 inputs, or ``emulate=True``) :class:`EmulatedFp8GroupedGemm` does the
same arithmetic in fp32: operands quantized to e4m3 with the same scales, dequantized, multiplied. It is the
reference the GPU path is tested against, and what FP8 MoE runs on a CPU for development.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.fp8.scaled_grouped_mm import (
    E4M3_MAX,
    ROW_ALIGN,
    ScaledGroupedMm,
    power_of_two_scale,
    scaled_grouped_mm_supported,
)


def e4m3_codes(t: torch.Tensor, dim: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """``t``'s e4m3 codes (as fp32 values) with one power-of-two scale per slice reduced over ``dim``, and the
    dequantizing scales (``codes * scales`` approximates ``t``; the scales keep ``dim`` as size 1)."""
    t32 = t.float()
    scale = power_of_two_scale(t32.abs().amax(dim=dim, keepdim=True))
    return (t32 * scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float(), scale.reciprocal()


def quantize_dequantize_e4m3(t: torch.Tensor, dim: int | tuple[int, ...]) -> torch.Tensor:
    """``t`` (as fp32) rounded through e4m3 with one power-of-two scale per slice reduced over ``dim``."""
    codes, inverse = e4m3_codes(t, dim)
    return codes * inverse


def _groups(tensor: torch.Tensor, counts: list[int]) -> tuple[torch.Tensor, ...]:
    return torch.split(tensor, counts, dim=0)


def emulated_grouped_wgrad(grad: torch.Tensor, x: torch.Tensor, counts: list[int], fp8_wgrad: bool) -> torch.Tensor:
    """``dW_e = dy_e.T @ x_e`` for every expert, ``[E, out, in]`` in fp32 (zeros for an expert without rows): from
    ``dy`` and ``x`` rounded through e4m3 with one scale per column within the expert's rows, or, without
    ``fp8_wgrad``, from the operands as they are."""
    per_expert = []
    for dy_e, x_e in zip(_groups(grad, counts), _groups(x, counts)):
        if dy_e.shape[0] == 0:
            per_expert.append(x.new_zeros(grad.shape[1], x.shape[1], dtype=torch.float32))
        elif fp8_wgrad:
            per_expert.append(quantize_dequantize_e4m3(dy_e, 0).t() @ quantize_dequantize_e4m3(x_e, 0))
        else:
            per_expert.append(dy_e.float().t() @ x_e.float())
    return torch.stack(per_expert)


class EmulatedFp8GroupedGemm(torch.autograd.Function):
    """``cat_e(x_e @ W_e.T)`` with FP8 (e4m3, row-wise scales) emulated in fp32; see the module docstring.

    ``counts[e]`` rows of ``x`` belong to expert ``e``; rows past ``sum(counts)`` are not allowed.
    The output and both gradients have the dtypes of ``x`` and ``weight``. ``fp8_wgrad=False``: the weight
    gradient from the unquantized ``dy`` and ``x``. ``w_codes`` (e4m3 ``[E, out, in]``), ``w_scale`` (dequantizing,
    ``[E, out]``) and ``w_codes_t`` (``[E, in, out]``): the weight's codes made beforehand (cached across a step's
    micro-batches), which the forward and the data gradient then read instead of casting ``weight``.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, counts: list[int],
                fp8_wgrad: bool = True, w_codes: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                w_codes_t: torch.Tensor | None = None) -> torch.Tensor:
        ctx.save_for_backward(x, weight, w_codes_t, w_scale)
        ctx.counts, ctx.fp8_wgrad = counts, fp8_wgrad
        x_q = quantize_dequantize_e4m3(x, -1)
        w_q = quantize_dequantize_e4m3(weight, -1) if w_codes is None else w_codes.float() * w_scale.float()[..., None]
        out = [xe @ w_q[e].t() for e, xe in enumerate(_groups(x_q, counts))]
        return torch.cat(out, dim=0).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        x, weight, w_codes_t, w_scale = ctx.saved_tensors
        counts = ctx.counts
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            # The forward's weight codes, their per-output-feature scales folded into dy before its cast.
            if w_codes_t is None:
                w_codes, w_inverse = e4m3_codes(weight, -1)
            else:
                w_codes, w_inverse = w_codes_t.transpose(-2, -1).float(), w_scale.float()[..., None]
            grad_x = torch.cat([quantize_dequantize_e4m3(dy * w_inverse[e, :, 0], -1) @ w_codes[e]
                                for e, dy in enumerate(_groups(grad.float(), counts))], dim=0).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = emulated_grouped_wgrad(grad, x, counts, ctx.fp8_wgrad).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None


def group_ends(counts: list[int], device: torch.device) -> torch.Tensor:
    """The int32 end offsets of groups of ``counts`` rows, on ``device``."""
    return torch.cumsum(torch.tensor(counts, dtype=torch.int32), 0, dtype=torch.int32).to(device)


def host_counts(caller: str, x: torch.Tensor, counts: list[int] | None,
                ends: torch.Tensor | None) -> list[int]:
    """The groups' row counts on the host (``ends`` read back when no ``counts``), checked to cover ``x``'s rows."""
    if counts is None:
        if ends is None:
            raise ValueError(f"{caller} needs counts or ends")
        counts = torch.diff(ends.to("cpu", torch.int64), prepend=torch.zeros(1, dtype=torch.int64)).tolist()
    if sum(counts) != x.shape[0]:
        raise ValueError(f"{caller}: counts sum to {sum(counts)}, x has {x.shape[0]} rows")
    return list(counts)


def device_ends(caller: str, x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None,
                ends: torch.Tensor | None) -> torch.Tensor:
    """The groups' int32 end offsets on ``x``'s device, with the Hopper kernel's alignment rules checked: every
    group, ``x``'s rows and the weight's ``out`` and ``in`` multiples of :data:`ROW_ALIGN`."""
    if ends is None:
        if counts is None:
            raise ValueError(f"{caller} needs counts or ends")
        if any(c % ROW_ALIGN for c in counts):
            raise ValueError(f"{caller}: every expert's row count must be a multiple of {ROW_ALIGN} on a GPU; "
                             f"got {list(counts)}")
        ends = group_ends(counts, x.device)
    if any(d % ROW_ALIGN for d in weight.shape[1:]) or x.shape[0] % ROW_ALIGN:
        raise ValueError(f"{caller}: the expert weight {tuple(weight.shape)} needs out and in, and x "
                         f"{tuple(x.shape)} its row count, to be multiples of {ROW_ALIGN}")
    return ends.to(torch.int32)


def fp8_grouped_gemm(x: torch.Tensor, weight: torch.Tensor, counts: list[int] | None = None,
                     ends: torch.Tensor | None = None, emulate: bool = False, fp8_wgrad: bool = True,
                     weight_codes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                     host_ends: torch.Tensor | None = None) -> torch.Tensor:
    """``cat_e(x_e @ weight[e].T)`` with FP8 operands (e4m3, row-wise scales), differentiable.

    ``x [N, in]`` rows grouped by expert, ``weight [E, out, in]``. The groups are given as host
    ``counts`` or as device int32 ``ends`` offsets. On a Hopper GPU with bf16 ``x``, unless ``emulate``, every
    group must start at a multiple of 16 rows and ``in``/``out`` be multiples of 16; elsewhere (or with
    ``emulate``) the arithmetic is emulated in fp32 (device ``ends`` are then read back to the host).
    ``fp8_wgrad=False``: the weight gradient in high precision from the unquantized ``dy`` and ``x`` (a Python
    constant, fixed when a compiled graph is traced). ``weight_codes``: ``weight``'s e4m3 codes ``[E, out, in]``,
    their dequantizing scales ``[E, out]`` and the codes transposed ``[E, in, out]``, made beforehand from ``weight``
    (:mod:`megatron_core.fp8.grouped_weight_cache` keeps them for a step's micro-batches); the GEMMs read them
    instead of casting ``weight``, whose gradient is computed as without them. ``host_ends``: the host copy of
    ``ends`` where the caller read it already (the ``per_expert`` GEMM mode, :mod:`megatron_core.fp8.expert_gemm_mode`).
    """
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"fp8_grouped_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [N, in] and "
                         "[E, out, in]")
    cached = weight_codes or (None, None, None)
    if emulate or not scaled_grouped_mm_supported(x):
        return EmulatedFp8GroupedGemm.apply(x, weight, host_counts("fp8_grouped_gemm", x, counts, ends), fp8_wgrad,
                                            *cached)
    return ScaledGroupedMm.apply(x.contiguous(), weight, device_ends("fp8_grouped_gemm", x, weight, counts, ends),
                                 fp8_wgrad, *cached, host_ends)
