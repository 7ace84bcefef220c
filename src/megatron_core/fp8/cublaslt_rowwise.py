"""Row-wise scaled float8 GEMMs through cuBLASLt, with the host's work per call kept small.

The per-expert FP8 GEMMs (:mod:`megatron_core.fp8.expert_gemm_mode`) launch one GEMM per expert, eight to a layer's
GEMM at Mixtral's shape. ``torch._scaled_mm`` spends about 40 us of host time on each (it builds the cuBLASLt
descriptors and asks cuBLASLt's heuristic for an algorithm at every call), which left the MoE step waiting for the
host (``benchmarks/RESULTS.md``, session 51). Here a plan (descriptors, layouts and the heuristic's algorithm) is
made once per GEMM shape class and kept: the row count and the contraction length, which change with the routing
(the forward's rows, the weight gradient's contraction), are set on the plan's layouts before each call, and the
algorithm is the one the heuristic chose for the powers of two at or above them.

The GEMM is ``out = (a * a_scale[:, None]) @ (b_t * b_scale[:, None]).T`` for e4m3 ``a [rows, k]`` and ``b_t
[cols, k]`` (each row contiguous, rows ``lda`` / ``ldb`` elements apart: column slices of a wider matrix are read in
place), fp32 dequantizing scales per row of ``a`` and per row of ``b_t`` (cuBLASLt's outer-vector scale mode, as
``torch._scaled_mm`` uses for row-wise scales), a bf16 ``out [rows, cols]`` written whole, and fast accumulation
(``use_fast_accum=True``). :func:`rowwise_scaled_mm_` returns False where it does not serve a call (no cuBLASLt, not
Hopper, a layout it does not take, or cuBLASLt refusing the call): callers then use ``torch._scaled_mm``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from megatron_core.fp8.cublaslt import (
    _CUBLAS_COMPUTE_32F,
    _CUDA_TYPES,
    _check,
    _handle,
    _HeuristicResult,
    _library,
)
from megatron_core.fp8.cublaslt import _workspace as _stream_workspace

__all__ = ["ENABLED", "rowwise_scaled_mm_", "serves_device"]

ENABLED = True  # False: the per-expert GEMMs call torch._scaled_mm (for comparisons)

# cublasLt.h enumerations not in megatron_core.fp8.cublaslt.
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_DESC_A_SCALE_MODE, _DESC_B_SCALE_MODE = 31, 32
_SCALE_OUTER_VEC_32F = 3
_LAYOUT_ROWS, _LAYOUT_COLS = 2, 3
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = (5, 6, 7, 8)  # a, b, c, d
_WORKSPACE_BYTES = 32 * 1024 * 1024
_ALIGN_BYTES = 16
_MIN_BUCKET = 128


def _bucket(size: int) -> int:
    """The size a plan's algorithm is chosen for: the power of two at or above ``size`` (at least 128)."""
    return max(_MIN_BUCKET, 1 << (size - 1).bit_length())


class _Plan:
    """Descriptors, layouts and algorithm of ``out [rows, cols] = a [rows, k] @ b_t [cols, k].T`` with row-wise scales.

    cuBLASLt is column-major: the row-major ``out`` is ``out.T [cols, rows] = b_t @ a.T``, so cuBLASLt's ``A`` is
    ``b_t`` (stored ``[k, cols]``, transposed), its ``B`` is ``a`` (stored ``[k, rows]``) and its ``C = D`` is
    ``out``; ``A``'s outer-vector scales are ``b_scale``, ``B``'s are ``a_scale``."""

    def __init__(self, device: int, rows: int, cols: int, k: int, lda: int, ldb: int, out_dtype: torch.dtype,
                 workspace_bytes: int, scale_pointers: tuple[int, int]) -> None:
        lib = _library()
        self.lib, self.handle, self.workspace_bytes = lib, _handle(device), workspace_bytes
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_TYPES[torch.float32]),
               "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, 1), (_DESC_TRANSB, 0), (_DESC_A_SCALE_MODE, _SCALE_OUTER_VEC_32F),
                            (_DESC_B_SCALE_MODE, _SCALE_OUTER_VEC_32F)):
            self._set(attr, ctypes.c_int32(value))
        self._set(_DESC_FAST_ACCUM, ctypes.c_int8(1))
        fp8 = _CUDA_TYPES[torch.float8_e4m3fn]
        self.layout_a = self._layout(fp8, k, cols, ldb)
        self.layout_b = self._layout(fp8, k, rows, lda)
        self.layout_c = self._layout(_CUDA_TYPES[out_dtype], cols, rows, cols)
        self.rows, self.k = rows, k
        self._set_scales(*scale_pointers)  # cuBLASLt's heuristic checks the scale vectors' pointers too
        self.algo, self.heuristic = None, []  # what the heuristic answered, for diagnosis
        for alignment in (_ALIGN_BYTES, None):  # without stating the alignment if cuBLASLt offers nothing with it
            self.algo = self._choose_algorithm(alignment)
            if self.algo is not None:
                break
        self.last_status = None
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _choose_algorithm(self, alignment: int | None) -> Any:
        """cuBLASLt's first choice for the plan's shape (with the operands' alignment stated, unless ``None``), or
        ``None``; ``(alignment, status, found, state)`` appended to ``self.heuristic``."""
        lib = self.lib
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        settings = [(_PREF_MAX_WORKSPACE_BYTES, ctypes.c_uint64(self.workspace_bytes))]
        if alignment is not None:
            settings += [(attr, ctypes.c_uint32(alignment)) for attr in _PREF_MIN_ALIGNMENT_BYTES]
        for attr, value in settings:
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(value), ctypes.sizeof(value)),
                   "cublasLtMatmulPreferenceSetAttribute")
        result, found = _HeuristicResult(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.layout_a, self.layout_b,
                                                    self.layout_c, self.layout_c, pref, 1, ctypes.byref(result),
                                                    ctypes.byref(found))
        self.heuristic.append((alignment, status, found.value, result.state))
        if status != 0 or found.value == 0 or result.state != 0:
            return None
        self._result = result  # keeps the algorithm's memory alive
        return ctypes.byref(result.algo)

    def _set_scales(self, a_scale_pointer: int, b_scale_pointer: int) -> None:
        """cuBLASLt's ``A`` scales are ``b_scale``, its ``B`` scales ``a_scale``."""
        self._set(_DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale_pointer))
        self._set(_DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale_pointer))

    def _set(self, attr: int, value: Any) -> None:
        _check(self.lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "cublasLtMatmulDescSetAttribute")

    def _layout(self, cuda_type: int, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), cuda_type, rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        return layout

    def _resize(self, layouts: tuple[ctypes.c_void_p, ...], attr: int, size: int) -> None:
        value = ctypes.c_uint64(size)
        for layout in layouts:
            _check(self.lib.cublasLtMatrixLayoutSetAttribute(layout, attr, ctypes.byref(value), 8),
                   "cublasLtMatrixLayoutSetAttribute")

    def run(self, out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor,
            b_scale: torch.Tensor, workspace: int | None, stream: int) -> bool:
        """The GEMM on ``stream``; False (nothing launched) where cuBLASLt refuses it."""
        rows, k = a.shape
        if rows != self.rows:  # the rows of a and out: columns of cuBLASLt's B and C
            self._resize((self.layout_b, self.layout_c), _LAYOUT_COLS, rows)
            self.rows = rows
        if k != self.k:  # the contraction: rows of cuBLASLt's A and B
            self._resize((self.layout_a, self.layout_b), _LAYOUT_ROWS, k)
            self.k = k
        self._set_scales(a_scale.data_ptr(), b_scale.data_ptr())
        status = self.last_status = self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self._one), b_t.data_ptr(), self.layout_a, a.data_ptr(),
            self.layout_b, ctypes.byref(self._zero), out.data_ptr(), self.layout_c, out.data_ptr(), self.layout_c,
            self.algo, workspace, self.workspace_bytes if workspace else 0, stream)
        return status == 0


_plans: dict[tuple, _Plan] = {}


def serves_device(device: torch.device) -> bool:
    """Whether :func:`rowwise_scaled_mm_` can serve GEMMs on ``device`` at all (enabled, CUDA with compute
    capability 9.0 or newer, cuBLASLt loaded); each call still checks its operands."""
    if not ENABLED or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0) and _library() is not None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % _ALIGN_BYTES == 0


def rowwise_scaled_mm_(out: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor,
                       b_scale: torch.Tensor) -> bool:
    """``out = (a * a_scale[:, None]) @ (b_t * b_scale[:, None]).T`` in one cuBLASLt GEMM (see the module), for
    e4m3 ``a [rows, k]`` and ``b_t [cols, k]`` with unit column stride, contiguous fp32 ``a_scale`` (``rows``
    elements) and ``b_scale`` (``cols``), a contiguous bf16 ``out [rows, cols]``, on a device :func:`serves_device`
    accepts. Returns False, launching nothing, where it does not serve the call."""
    rows, k = a.shape
    cols = b_t.shape[0]
    if (not out.is_cuda or a.dtype != torch.float8_e4m3fn or b_t.dtype != torch.float8_e4m3fn
            or out.dtype != torch.bfloat16
            or a.stride(1) != 1 or b_t.stride(1) != 1 or not out.is_contiguous() or out.shape != (rows, cols)
            or b_t.shape[1] != k or rows == 0 or a.stride(0) % 16 or b_t.stride(0) % 16 or k % 16 or cols % 8
            or a_scale.numel() != rows or b_scale.numel() != cols or a_scale.dtype != torch.float32
            or b_scale.dtype != torch.float32 or not (a_scale.is_contiguous() and b_scale.is_contiguous())
            or not (_aligned(a) and _aligned(b_t) and _aligned(out))):
        return False
    device = out.device.index
    stream = torch.cuda.current_stream(device).cuda_stream
    workspace = _stream_workspace(device, stream)
    key = (device, _bucket(rows), cols, _bucket(k), a.stride(0), b_t.stride(0), workspace is not None)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Plan(device, key[1], cols, key[3], a.stride(0), b_t.stride(0), out.dtype,
                                   _WORKSPACE_BYTES if workspace else 0, (a_scale.data_ptr(), b_scale.data_ptr()))
    if plan.algo is None:
        return False
    return plan.run(out, a, a_scale, b_t, b_scale, workspace, stream)
