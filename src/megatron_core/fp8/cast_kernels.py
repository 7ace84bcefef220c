"""Triton kernels for the float8 casts of the FP8 GEMMs, on CUDA.

For the dense FP8-parameter layers (:mod:`megatron_core.fp8.fp8_param_linear`):
- :func:`cast_transpose`: ``t [M, K]`` times a per-tensor scale as float8 codes, written twice in one pass, row-major
  ``[M, K]`` and transposed ``[K, M16]`` (rows zero-padded to a multiple of 16): both operands the GEMMs of a
  backward pass need from one tensor (the output gradient: the data gradient reads it row-major, the weight
  gradient transposed), where two Inductor kernels read the tensor twice and its transposing copy of one-byte
  elements runs well below the memory bandwidth. Codes equal :func:`megatron_core.distributed.fp8_params.quantize`'s
  bit for bit.

For the experts' FP8 grouped GEMM (e4m3, power-of-two scales):

Two casts dominate an FP8 MoE step besides the GEMMs, and Inductor writes neither well from plain PyTorch:
- :func:`rowwise_cast`: one scale per row of ``t [M, K]`` (optionally after multiplying each row by a per-group
  row of factors, the weight scales folded into ``dy`` for the data gradient): codes ``[M, K]`` and the
  dequantizing scales ``[M]``. Rows of up to :data:`WHOLE_ROW_MAX` elements are read once: a program holds whole
  rows in registers, takes their maxima and casts them (a few rows per program for short rows, so that a tensor
  of few rows still spreads over every SM). Longer rows take two passes over a block of rows, one for the
  maxima, one to cast.
- :func:`group_columnwise_cast_transposed`: one scale per column within each group of rows (the weight
  gradient's operands), written transposed (``[K, M]`` row-major, as the kernel's 2D x 2D form reads them):
  a kernel for the per-group column maxima (each group's rows split over several programs whose maxima join by
  an atomic maximum, so that few groups still fill the GPU), a tiled kernel that casts and transposes, placing
  each row where a given layout says (zero columns between groups padded to a longer contraction).
- :func:`transpose_codes`: the forward's weight codes transposed for the data gradient, by byte tiles.
The scale of a slice is ``2**floor(log2(448 / amax))``, taken from the exponent bits of a correctly rounded
division, so codes and scales equal the PyTorch formula's (:mod:`megatron_core.fp8.scaled_grouped_mm`) bit
for bit. The ops are ``torch.library.triton_op``s, traced as they are by ``torch.compile``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.fp8.delayed_linear import MM_ALIGN
from megatron_core.jit import (
    direct_triton_launches,
    have_triton,
    kernel_device,
    shared_kernel_input,
    triton_modules,
    triton_op,
)

__all__ = ["cast_transpose", "cast_transpose_serves", "codes_and_transposed", "fp8_cast_kernels_available",
           "group_columnwise_cast_transposed", "rowwise_cast", "rowwise_cast_into", "transpose_codes",
           "transpose_codes_into"]

E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)
AMAX_EPS = 1e-12
_ROW_BLOCK, _COL_BLOCK, _ROW_WARPS = 16, 256, 4  # two-pass rowwise cast: rows per program, columns per step, warps
WHOLE_ROW_MAX = 32768  # rowwise cast: the longest row held in registers whole (one read); longer rows take two passes
_WHOLE_ROW_ELEMENTS = 8192  # rowwise cast of whole rows: elements per program (short rows: several rows each)
_TILE, _TILE_WARPS = 64, 4  # the transposing cast's square tile, its warps
_BYTE_TILE = 128  # the byte transpose's square tile
# Group column maxima: rows per step, columns per program, programs sharing one group's rows, warps.
_AMAX_ROWS, _AMAX_COLS, _AMAX_SPLIT, _AMAX_WARPS = 64, 64, 8, 4
_DUAL_CONFIGS = ((64, 128, 4), (128, 128, 8), (128, 64, 4), (64, 64, 4))  # cast_transpose: rows, columns, warps


def fp8_cast_kernels_available(t: torch.Tensor) -> bool:
    """Whether the Triton casts serve ``t`` (a contiguous CUDA tensor, Triton and ``triton_op`` present)."""
    return t.is_cuda and t.is_contiguous() and _ROWWISE_OP is not None and have_triton()


@functools.cache
def _kernels() -> tuple[Any, Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def rowwise_kernel(t_ptr, factor_ptr, group_ptr, out_ptr, inv_ptr, rows, cols,
                       HAS_FACTOR: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        r_ok = r < rows
        base = r.to(tl.int64)[:, None] * cols
        if HAS_FACTOR:
            fbase = tl.load(group_ptr + r, mask=r_ok, other=0).to(tl.int64)[:, None] * cols
        amax = tl.zeros([BR], dtype=tl.float32)
        for c0 in range(0, cols, BC):
            c = c0 + tl.arange(0, BC)
            ok = r_ok[:, None] & (c < cols)[None, :]
            v = tl.load(t_ptr + base + c[None, :], mask=ok, other=0.0).to(tl.float32)
            if HAS_FACTOR:
                v = v * tl.load(factor_ptr + fbase + c[None, :], mask=ok, other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=1))
        # 2**floor(log2(448 / amax)): the exponent bits of the correctly rounded quotient
        ratio = tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.maximum(amax, 1e-12))
        scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        tl.store(inv_ptr + r, 1.0 / scale, mask=r_ok)
        for c0 in range(0, cols, BC):
            c = c0 + tl.arange(0, BC)
            ok = r_ok[:, None] & (c < cols)[None, :]
            v = tl.load(t_ptr + base + c[None, :], mask=ok, other=0.0).to(tl.float32)
            if HAS_FACTOR:
                v = v * tl.load(factor_ptr + fbase + c[None, :], mask=ok, other=0.0)
            q = tl.clamp(v * scale[:, None], -448.0, 448.0)
            tl.store(out_ptr + base + c[None, :], q.to(tl.float8e4nv), mask=ok)

    @triton.jit
    def cast_transposed_kernel(t_ptr, source_ptr, group_ptr, scale_ptr, out_ptr, rows, cols, T: tl.constexpr):
        # out[c, r] = cast(t[source[r], c] * scale[group[r], c]); a source of -1 gives a zero column of out
        r = tl.program_id(0) * T + tl.arange(0, T)
        c = tl.program_id(1) * T + tl.arange(0, T)
        in_r = r < rows
        src = tl.load(source_ptr + r, mask=in_r, other=-1)
        inside = in_r[:, None] & (c < cols)[None, :]
        ok = (src >= 0)[:, None] & inside
        v = tl.load(t_ptr + src.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
        g = tl.load(group_ptr + r, mask=in_r, other=0)
        s = tl.load(scale_ptr + g[:, None] * cols + c[None, :], mask=inside, other=1.0)
        q = tl.clamp(v * s, -448.0, 448.0).to(tl.float8e4nv)
        tl.store(out_ptr + c.to(tl.int64)[:, None] * rows + r[None, :], tl.trans(q), mask=tl.trans(inside))

    @triton.jit
    def transpose_kernel(src_ptr, dst_ptr, rows, cols, T: tl.constexpr):
        base = tl.program_id(2).to(tl.int64) * rows * cols
        r = tl.program_id(0) * T + tl.arange(0, T)
        c = tl.program_id(1) * T + tl.arange(0, T)
        ok = (r < rows)[:, None] & (c < cols)[None, :]
        v = tl.load(src_ptr + base + r.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0)
        tl.store(dst_ptr + base + c.to(tl.int64)[:, None] * rows + r[None, :], tl.trans(v), mask=tl.trans(ok))

    return rowwise_kernel, cast_transposed_kernel, transpose_kernel


@functools.cache
def _group_amax_kernels() -> tuple[Any, Any]:
    triton, tl = triton_modules()

    @triton.jit
    def group_amax_split_kernel(t_ptr, ends_ptr, bits_ptr, cols, BR: tl.constexpr, BC: tl.constexpr,
                                SPLIT: tl.constexpr):
        # program (column block, group, part): the part-th of SPLIT row ranges of the group (whole steps of BR
        # rows); its column maxima joined by an atomic maximum of their bits (non-negative floats order as ints)
        g = tl.program_id(1)
        c = tl.program_id(0) * BC + tl.arange(0, BC)
        c_ok = c < cols
        start = tl.load(ends_ptr + tl.maximum(g - 1, 0))
        start = tl.where(g == 0, 0, start)
        end = tl.load(ends_ptr + g)
        per = ((end - start + SPLIT - 1) // SPLIT + BR - 1) // BR * BR
        lo = start + tl.program_id(2) * per
        hi = tl.minimum(end, lo + per)
        amax = tl.zeros([BC], dtype=tl.float32)
        for r0 in range(lo, hi, BR):
            r = r0 + tl.arange(0, BR)
            ok = (r < hi)[:, None] & c_ok[None, :]
            v = tl.load(t_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(v), axis=0))
        tl.atomic_max(bits_ptr + g * cols + c, amax.to(tl.int32, bitcast=True), mask=c_ok)

    @triton.jit
    def amax_scale_kernel(bits_ptr, scale_ptr, inv_ptr, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        ok = i < n
        amax = tl.load(bits_ptr + i, mask=ok, other=0).to(tl.float32, bitcast=True)
        # 2**floor(log2(448 / amax)), as in rowwise_kernel
        ratio = tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.maximum(amax, 1e-12))
        scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        tl.store(scale_ptr + i, scale, mask=ok)
        tl.store(inv_ptr + i, 1.0 / scale, mask=ok)

    return group_amax_split_kernel, amax_scale_kernel


@functools.cache
def _whole_row_kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def rowwise_whole_kernel(t_ptr, factor_ptr, group_ptr, out_ptr, inv_ptr, rows, cols,
                             HAS_FACTOR: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.arange(0, BC)
        r_ok = r < rows
        ok = r_ok[:, None] & (c < cols)[None, :]
        v = tl.load(t_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
        if HAS_FACTOR:
            fbase = tl.load(group_ptr + r, mask=r_ok, other=0).to(tl.int64)[:, None] * cols
            v = v * tl.load(factor_ptr + fbase + c[None, :], mask=ok, other=0.0)
        amax = tl.max(tl.abs(v), axis=1)
        # 2**floor(log2(448 / amax)), as in rowwise_kernel
        ratio = tl.math.div_rn(tl.zeros_like(amax) + 448.0, tl.maximum(amax, 1e-12))
        scale = ((ratio.to(tl.int32, bitcast=True) >> 23) << 23).to(tl.float32, bitcast=True)
        tl.store(inv_ptr + r, 1.0 / scale, mask=r_ok)
        q = tl.clamp(v * scale[:, None], -448.0, 448.0)
        tl.store(out_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], q.to(tl.float8e4nv), mask=ok)

    return rowwise_whole_kernel


def whole_row_blocks(cols: int) -> tuple[int, int, int]:
    """``(rows per program, columns per program, warps)`` of the one-pass row-wise cast of rows of ``cols``
    elements (at most :data:`WHOLE_ROW_MAX`): the row padded to a power of two, rows per program filling
    :data:`_WHOLE_ROW_ELEMENTS`, warps keeping 32 or 64 fp32 values per thread."""
    width = 1 << max(cols - 1, 0).bit_length()
    per_program = max(width, _WHOLE_ROW_ELEMENTS)
    return per_program // width, width, 16 if per_program > 16384 else 8


@functools.cache
def _dual_kernel() -> Any:
    triton, tl = triton_modules()
    configs = [triton.Config({"BR": r, "BC": c}, num_warps=w) for r, c, w in _DUAL_CONFIGS]

    @triton.autotune(configs=configs, key=["rows", "cols", "E5M2"])
    @triton.jit
    def cast_dual_kernel(t_ptr, scale_ptr, q_ptr, qt_ptr, rows, cols, padded_rows, limit,
                         E5M2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        c_ok = (c < cols)[None, :]
        ok = (r < rows)[:, None] & c_ok
        v = tl.load(t_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], mask=ok, other=0.0).to(tl.float32)
        v = tl.clamp(v * tl.load(scale_ptr), -limit, limit)
        q = v.to(tl.float8e5) if E5M2 else v.to(tl.float8e4nv)
        tl.store(q_ptr + r.to(tl.int64)[:, None] * cols + c[None, :], q, mask=ok)
        padded_ok = (r < padded_rows)[:, None] & c_ok  # the padding rows of the transposed copy get zeros
        tl.store(qt_ptr + c.to(tl.int64)[:, None] * padded_rows + r[None, :], tl.trans(q), mask=tl.trans(padded_ok))

    return cast_dual_kernel


def _launch_rowwise(t: torch.Tensor, factors: torch.Tensor, row_groups: torch.Tensor, has_factors: bool,
                    out: torch.Tensor, inverse: torch.Tensor) -> None:
    rows, cols = t.shape
    if cols <= WHOLE_ROW_MAX:
        block_rows, block_cols, warps = whole_row_blocks(cols)
        kernel = torch.library.wrap_triton(_whole_row_kernel())
        kernel[(-(-rows // block_rows),)](t, factors, row_groups, out, inverse, rows, cols, HAS_FACTOR=has_factors,
                                          BR=block_rows, BC=block_cols, num_warps=warps)
        return
    kernel = torch.library.wrap_triton(_kernels()[0])
    kernel[(-(-rows // _ROW_BLOCK),)](t, factors, row_groups, out, inverse, rows, cols, HAS_FACTOR=has_factors,
                                      BR=_ROW_BLOCK, BC=_COL_BLOCK, num_warps=_ROW_WARPS)


def _rowwise(t: torch.Tensor, factors: torch.Tensor, row_groups: torch.Tensor, has_factors: bool
             ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    out = torch.empty(rows, cols, dtype=torch.float8_e4m3fn, device=t.device)
    inverse = torch.empty(rows, dtype=torch.float32, device=t.device)
    _launch_rowwise(t, factors, row_groups, has_factors, out, inverse)
    return out, inverse


def _group_columnwise(t: torch.Tensor, ends: torch.Tensor, source_rows: torch.Tensor, column_groups: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    groups = ends.numel()
    bits = torch.zeros(groups, cols, dtype=torch.int32, device=t.device)
    scale = torch.empty(groups, cols, dtype=torch.float32, device=t.device)
    inverse = torch.empty(groups, cols, dtype=torch.float32, device=t.device)
    amax_kernel, scale_kernel = (torch.library.wrap_triton(k) for k in _group_amax_kernels())
    amax_kernel[(-(-cols // _AMAX_COLS), groups, _AMAX_SPLIT)](t, ends, bits, cols, BR=_AMAX_ROWS, BC=_AMAX_COLS,
                                                               SPLIT=_AMAX_SPLIT, num_warps=_AMAX_WARPS)
    scale_kernel[(-(-(groups * cols) // 1024),)](bits, scale, inverse, groups * cols, B=1024)
    out_rows = source_rows.numel()
    out = torch.empty(cols, out_rows, dtype=torch.float8_e4m3fn, device=t.device)
    cast_kernel = torch.library.wrap_triton(_kernels()[1])
    cast_kernel[(-(-out_rows // _TILE), -(-cols // _TILE))](t, source_rows, column_groups, scale, out, out_rows, cols,
                                                            T=_TILE, num_warps=_TILE_WARPS)
    return out, inverse.reshape(-1)


def _launch_transpose(t: torch.Tensor, out: torch.Tensor) -> None:
    batch, rows, cols = t.shape
    kernel = torch.library.wrap_triton(_kernels()[2])
    kernel[(-(-rows // _BYTE_TILE), -(-cols // _BYTE_TILE), batch)](t, out, rows, cols, T=_BYTE_TILE)


def _transpose_bytes(t: torch.Tensor) -> torch.Tensor:
    batch, rows, cols = t.shape
    out = torch.empty(batch, cols, rows, dtype=t.dtype, device=t.device)
    _launch_transpose(t, out)
    return out


def codes_and_transposed(like: torch.Tensor, rows: int, cols: int, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty e5m2 (else e4m3) codes ``[rows, cols]`` and their transposed copy ``[cols, rows16]`` on ``like``'s
    device, as :func:`cast_transpose` writes them: the copy's rows padded to the float8 GEMM's alignment of its
    reduction dimension."""
    dtype = torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn
    return like.new_empty(rows, cols, dtype=dtype), like.new_empty(cols, rows + (-rows % MM_ALIGN), dtype=dtype)


def _cast_dual(t: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = t.shape
    codes, transposed = codes_and_transposed(t, rows, cols, e5m2)
    padded = transposed.shape[1]

    def grid(meta: dict) -> tuple[int, int]:
        return (-(-padded // meta["BR"]), -(-cols // meta["BC"]))

    with torch.cuda.device(t.device):
        _dual_kernel()[grid](t, scale, codes, transposed, rows, cols, padded, float(torch.finfo(codes.dtype).max),
                             E5M2=e5m2)
    return codes, transposed


# An opaque op (Inductor calls it as it is): Inductor's own compilation of this kernel as a user-defined Triton
# kernel fails in the LLVM lowering of torch 2.11's Triton ("PassManager::run failed"), Triton's own does not.
_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("fp8_cast_transpose(Tensor t, Tensor scale, bool e5m2) -> (Tensor, Tensor)")
_LIBRARY.impl("fp8_cast_transpose", _cast_dual, "CUDA")


@torch.library.register_fake("megatron_core::fp8_cast_transpose", lib=_LIBRARY)
def _(t: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return codes_and_transposed(t, *t.shape, e5m2)


_ROWWISE_OP = triton_op("megatron_core::fp8_rowwise_cast", _rowwise)
_GROUP_COLUMNWISE_OP = triton_op("megatron_core::fp8_group_columnwise_cast", _group_columnwise)
_TRANSPOSE_OP = triton_op("megatron_core::transpose_bytes", _transpose_bytes)


def cast_transpose_serves(t: torch.Tensor) -> bool:
    """Whether :func:`cast_transpose` (and :func:`transpose_codes`) serve ``t``: a contiguous 2-D CUDA tensor, Triton
    present."""
    return t.dim() == 2 and t.is_cuda and t.is_contiguous() and _TRANSPOSE_OP is not None and have_triton()


def cast_transpose(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, K]`` times the one-element fp32 ``scale``, saturated and cast to float8 ``dtype`` (e4m3 or e5m2), as
    codes ``[M, K]`` and as their transposed copy ``[K, M16]`` whose columns past ``M`` are zeros (``M16``: ``M``
    rounded up to a multiple of 16); see :func:`cast_transpose_serves`."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"cast_transpose: dtype {dtype} is not float8_e4m3fn or float8_e5m2")
    return torch.ops.megatron_core.fp8_cast_transpose(t, scale.float().reshape(1), dtype == torch.float8_e5m2)


def transpose_codes(codes: torch.Tensor) -> torch.Tensor:
    """The e4m3 ``codes [E, R, C]`` (contiguous) copied to ``[E, C, R]`` contiguous, by tiles (Inductor's
    transposing copy of one-byte elements is several times slower)."""
    return _TRANSPOSE_OP(codes.view(torch.uint8)).view(codes.dtype)


def rowwise_cast_into(t: torch.Tensor, codes: torch.Tensor, inverse: torch.Tensor) -> None:
    """:func:`rowwise_cast` of ``t [M, K]`` written into ``codes [M, K]`` (e4m3) and ``inverse [M]`` (fp32), all
    contiguous on ``t``'s CUDA device: for eager callers that own the buffers (an opaque op under ``torch.compile``,
    as the experts' weight cache refresh), so that no copy follows the cast; launched directly
    (:func:`~megatron_core.jit.direct_triton_launches`)."""
    with kernel_device(t), direct_triton_launches():
        _launch_rowwise(t, t, t.new_zeros(1, dtype=torch.int32), False, codes, inverse)


def transpose_codes_into(codes: torch.Tensor, out: torch.Tensor) -> None:
    """:func:`transpose_codes` of ``codes [E, R, C]`` written into ``out [E, C, R]`` (both contiguous, on CUDA), for
    eager callers as :func:`rowwise_cast_into`."""
    with kernel_device(codes), direct_triton_launches():
        _launch_transpose(codes.view(torch.uint8), out.view(torch.uint8))


def rowwise_cast(t: torch.Tensor, factors: torch.Tensor | None = None, row_groups: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, K]`` (times ``factors[row_groups[m]]`` per row when given) as e4m3 codes with one power-of-two
    scale per row, and the dequantizing scales ``[M]``."""
    t = shared_kernel_input(t)  # read as two kernel arguments (the factors' place holds t when there are none)
    if factors is None:
        return _ROWWISE_OP(t, t, t.new_zeros(1, dtype=torch.int32), False)
    return _ROWWISE_OP(t, factors.float().contiguous(), row_groups.to(torch.int32), True)


def group_columnwise_cast_transposed(t: torch.Tensor, ends: torch.Tensor, row_groups: torch.Tensor | None,
                                     layout: tuple[torch.Tensor, torch.Tensor] | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t [M, C]`` as e4m3 codes with one power-of-two scale per column within each group of rows (groups end
    at ``ends``; ``row_groups [M]`` names each row's), transposed to ``[C, M]`` row-major; and the dequantizing
    scales ``[groups * C]``, group-major. ``layout``: ``(source_rows [L], column_groups [L])`` places the
    transposed rows otherwise (``row_groups`` is then not read): column ``j`` of the result (``[C, L]``) is row
    ``source_rows[j]`` of ``t``, scaled as group ``column_groups[j]``, or zeros where ``source_rows[j]`` is -1 (e.g.
    groups padded with zero columns, :func:`megatron_core.fp8.scaled_grouped_mm.aligned_contraction_layout`)."""
    if layout is None:
        layout = (torch.arange(t.shape[0], device=t.device, dtype=torch.int32), row_groups)
    source_rows, column_groups = layout
    return _GROUP_COLUMNWISE_OP(shared_kernel_input(t), ends.to(torch.int32), source_rows.to(torch.int32),
                                column_groups.to(torch.int32))
