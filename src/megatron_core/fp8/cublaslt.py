"""A float8 GEMM that adds its product into its output (cuBLASLt's ``beta = 1``), called through ``ctypes``.

``torch._scaled_mm`` writes its product to a new tensor (``beta = 0``). An FP8 layer's weight gradient then needs a
second kernel that reads and writes all of ``main_grad`` again to add it (134 us per 3B-class layer and micro-batch
on an H200, benchmarks/RESULTS.md 2026-12-03). cuBLASLt computes ``D = alpha * scale_a * scale_b * op(A) op(B) + beta
* C`` and allows ``C`` and ``D`` to be one buffer: with ``beta = 1`` the GEMM's epilogue adds the product into
``main_grad``. The descriptor is the one PyTorch builds for ``torch._scaled_mm`` (fp32 compute and scale type, per-tensor
scale pointers, fast accumulation off), so the product is accumulated as precisely; Megatron-Core's bf16 fused
weight-gradient accumulation uses cuBLAS's ``beta`` the same way.

The library is the ``libcublasLt`` that the CUDA build of torch has loaded (found in the process's memory map, else
by its soname). :func:`accumulates` says whether a call can be served (library found, compute capability 8.9 or
newer, float8 operands contiguous along the reduction, 16-byte aligned sizes, an algorithm that cuBLASLt's
heuristic offers for the shape); callers fall back to ``torch._scaled_mm`` and an add otherwise. The calls are
recorded by CUDA graphs like any cuBLAS call: a stream's workspace is allocated outside torch's allocator and any
graph's memory pool, at its first call outside a capture; a stream first seen inside a capture gets an algorithm that
needs no workspace.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

__all__ = ["accumulates", "scaled_mm_accumulate_"]

# cuBLAS / CUDA enumerations (cublas_api.h, library_types.h, cublasLt.h).
_CUBLAS_COMPUTE_32F = 68
_CUDA_TYPES = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: 28,
               torch.float8_e5m2: 29}
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB = 3, 4
_DESC_A_SCALE_POINTER, _DESC_B_SCALE_POINTER = 17, 18
_DESC_FAST_ACCUM = 25
_PREF_MAX_WORKSPACE_BYTES = 1
_PREF_MIN_ALIGNMENT_BYTES = {"a": 5, "b": 6, "c": 7, "d": 8}
_MAX_ALIGNMENT = 256  # what cuBLASLt assumes of a pointer unless told less
_WORKSPACE_BYTES = 32 * 1024 * 1024  # what cuBLASLt's Hopper kernels may ask for (PyTorch's default there)
_ALIGN_BYTES = 16


class _HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""

    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _loaded_library_path(stem: str) -> str | None:
    """The path of the library ``stem`` (``libcublasLt``, ``libcudart``) this process has mapped (torch's), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            for line in maps:
                path = line.split()[-1] if line.strip() else ""
                if os.path.basename(path).startswith(stem + ".so"):
                    return path
    except OSError:
        return None
    return None


def _load(stem: str) -> Any:
    """The CUDA library ``stem`` that torch loaded (else found by its soname) as a ``ctypes`` library, or ``None``."""
    candidates = [p for p in [_loaded_library_path(stem)] if p]
    candidates += [f"{stem}.so.{v}" for v in (torch.version.cuda or "").split(".")[:1]] + [f"{stem}.so"]
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


@functools.cache
def _library() -> Any:
    """cuBLASLt as a ``ctypes`` library, or ``None`` where it cannot be loaded."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    lib = _load("libcublasLt")
    if lib is not None:
        _declare(lib)
    return lib


@functools.cache
def _runtime() -> Any:
    """The CUDA runtime as a ``ctypes`` library (for the workspace's ``cudaMalloc``), or ``None``."""
    lib = _load("libcudart")
    if lib is not None:
        lib.cudaMalloc.argtypes, lib.cudaMalloc.restype = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t], ctypes.c_int
    return lib


def _declare(lib: Any) -> None:
    """Argument and result types of the cuBLASLt functions used here."""
    vp, sz, u64, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_int64
    signatures = {
        "cublasLtCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulDescCreate": [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int],
        "cublasLtMatmulDescSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatrixLayoutCreate": [ctypes.POINTER(vp), ctypes.c_int, u64, u64, i64],
        "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(vp)],
        "cublasLtMatmulPreferenceSetAttribute": [vp, ctypes.c_int, vp, sz],
        "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int,
                                           ctypes.POINTER(_HeuristicResult), ctypes.POINTER(ctypes.c_int)],
        "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.cublasLtGetStatusString.argtypes, lib.cublasLtGetStatusString.restype = [ctypes.c_int], ctypes.c_char_p


def _check(status: int, what: str) -> None:
    """Raise naming the cuBLASLt call and its status unless ``status`` is success."""
    if status != 0:
        message = _library().cublasLtGetStatusString(status).decode()
        raise RuntimeError(f"cuBLASLt {what} failed with status {status} ({message})")


@functools.cache
def _handle(device: int) -> ctypes.c_void_p:
    """One cuBLASLt handle per device."""
    with torch.cuda.device(device):
        handle = ctypes.c_void_p()
        _check(_library().cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    return handle


_workspaces: dict[tuple[int, int], int] = {}  # (device, stream) -> device pointer of its workspace


def _workspace(device: int, stream: int) -> int | None:
    """The workspace of calls on ``stream`` (one per stream, as PyTorch's cuBLAS workspaces), allocated with
    ``cudaMalloc`` at the first call outside a stream capture and kept for the process: outside torch's caching
    allocator, whose allocations during Inductor's CUDA-graph warm-up go to the graphs' private pool (where a buffer
    kept across calls is an error). ``None`` inside a capture before that, or where the runtime cannot be loaded."""
    key = (device, stream)
    if key not in _workspaces:
        runtime = _runtime()
        if torch.cuda.is_current_stream_capturing() or runtime is None:
            return None
        pointer = ctypes.c_void_p()
        with torch.cuda.device(device):
            status = runtime.cudaMalloc(ctypes.byref(pointer), _WORKSPACE_BYTES)
        if status != 0:
            raise RuntimeError(f"cudaMalloc of the {_WORKSPACE_BYTES}-byte cuBLASLt workspace on device {device} "
                               f"failed with CUDA error {status}")
        _workspaces[key] = pointer.value
    return _workspaces[key]


class _Plan:
    """The descriptors and the algorithm of one GEMM shape and its dtypes (``None`` algorithm: not served)."""

    def __init__(self, device: int, m: int, n: int, k: int, a_dtype: torch.dtype, b_dtype: torch.dtype,
                 out_dtype: torch.dtype, alignments: tuple[int, int, int], workspace_bytes: int) -> None:
        lib = _library()
        self.desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), _CUBLAS_COMPUTE_32F, _CUDA_TYPES[torch.float32]),
               "cublasLtMatmulDescCreate")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N)):
            self._set(attr, ctypes.c_int32(value))
        self._set(_DESC_FAST_ACCUM, ctypes.c_int8(0))
        # cuBLAS is column-major: row-major out [m, n] is out^T [n, m] = b_t @ a^T. cuBLAS's A is b_t (stored as
        # [k, n] column-major, transposed), its B is a (stored as [k, m]), its C = D is out (stored as [n, m]).
        self.layout_a = self._layout(b_dtype, k, n, k)
        self.layout_b = self._layout(a_dtype, k, m, k)
        self.layout_c = self._layout(out_dtype, n, m, n)
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "cublasLtMatmulPreferenceCreate")
        # The pointers' alignments (a, b_t, out): cuBLASLt's A is b_t, its B is a, its C and D are out.
        align_a, align_b_t, align_out = alignments
        self.workspace_bytes = workspace_bytes
        for attr, value in ((_PREF_MAX_WORKSPACE_BYTES, workspace_bytes), (_PREF_MIN_ALIGNMENT_BYTES["a"], align_b_t),
                            (_PREF_MIN_ALIGNMENT_BYTES["b"], align_a), (_PREF_MIN_ALIGNMENT_BYTES["c"], align_out),
                            (_PREF_MIN_ALIGNMENT_BYTES["d"], align_out)):
            size = ctypes.c_uint64(value) if attr == _PREF_MAX_WORKSPACE_BYTES else ctypes.c_uint32(value)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(size), ctypes.sizeof(size)),
                   "cublasLtMatmulPreferenceSetAttribute")
        result, found = _HeuristicResult(), ctypes.c_int(0)
        status = lib.cublasLtMatmulAlgoGetHeuristic(_handle(device), self.desc, self.layout_a, self.layout_b,
                                                    self.layout_c, self.layout_c, pref, 1, ctypes.byref(result),
                                                    ctypes.byref(found))
        self.algo = result if status == 0 and found.value > 0 and result.state == 0 else None

    def _set(self, attr: int, value: Any) -> None:
        _check(_library().cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
               "cublasLtMatmulDescSetAttribute")

    @staticmethod
    def _layout(dtype: torch.dtype, rows: int, cols: int, ld: int) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        _check(_library().cublasLtMatrixLayoutCreate(ctypes.byref(layout), _CUDA_TYPES[dtype], rows, cols, ld),
               "cublasLtMatrixLayoutCreate")
        return layout

    def run(self, out: torch.Tensor, a: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor,
            b_scale_inv: torch.Tensor, workspace: int | None, stream: int) -> None:
        """``out += (a * a_scale_inv) @ (b_t * b_scale_inv).T`` on ``stream``."""
        self._set(_DESC_A_SCALE_POINTER, ctypes.c_void_p(b_scale_inv.data_ptr()))
        self._set(_DESC_B_SCALE_POINTER, ctypes.c_void_p(a_scale_inv.data_ptr()))
        one = ctypes.c_float(1.0)
        _check(_library().cublasLtMatmul(
            _handle(out.device.index), self.desc, ctypes.byref(one), b_t.data_ptr(), self.layout_a, a.data_ptr(),
            self.layout_b, ctypes.byref(one), out.data_ptr(), self.layout_c, out.data_ptr(), self.layout_c,
            ctypes.byref(self.algo.algo), workspace, self.workspace_bytes, stream), "cublasLtMatmul")


@functools.cache
def _cached_plan(*key: Any) -> _Plan:
    return _Plan(*key)


def _alignment(t: torch.Tensor) -> int:
    """The largest power of two up to 256 that divides ``t``'s address."""
    address = t.data_ptr()
    return min(_MAX_ALIGNMENT, address & -address) if address else _MAX_ALIGNMENT


def _plan(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> tuple[_Plan, int | None]:
    """The plan of ``out += a @ b_t.T`` and the workspace of the current stream; without one (a stream first seen
    inside a capture) the plan of an algorithm that needs none."""
    device = out.device.index
    workspace = _workspace(device, torch.cuda.current_stream(device).cuda_stream)
    plan = _cached_plan(device, a.shape[0], b_t.shape[0], a.shape[1], a.dtype, b_t.dtype, out.dtype,
                        (_alignment(a), _alignment(b_t), _alignment(out)), _WORKSPACE_BYTES if workspace else 0)
    return plan, workspace


def _aligned(t: torch.Tensor) -> bool:
    """Sizes and address on 16-byte boundaries (what cuBLASLt's float8 GEMMs need at least)."""
    return all(size * t.element_size() % _ALIGN_BYTES == 0 for size in t.shape) and _alignment(t) >= _ALIGN_BYTES


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _served_plan(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> tuple[_Plan, int | None] | None:
    """The plan and workspace of ``out [m, n] += a [m, k] @ b_t [n, k].T``, or ``None`` where it is not served (see
    the module)."""
    if not (out.is_cuda and a.is_cuda and b_t.is_cuda) or torch.cuda.get_device_capability(out.device) < (8, 9):
        return None
    if a.dtype not in _FP8 or b_t.dtype not in _FP8 or a.dtype == b_t.dtype == torch.float8_e5m2:
        return None  # cuBLASLt has no e5m2 x e5m2 GEMM
    if out.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    if a.dim() != 2 or b_t.dim() != 2 or out.shape != (a.shape[0], b_t.shape[0]) or a.shape[1] != b_t.shape[1]:
        return None
    if not (a.is_contiguous() and b_t.is_contiguous() and out.is_contiguous()):
        return None
    if not (_aligned(a) and _aligned(b_t) and _aligned(out)) or _library() is None or _runtime() is None:
        return None
    plan, workspace = _plan(out, a, b_t)
    return (plan, workspace) if plan.algo is not None else None


def accumulates(out: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor) -> bool:
    """Whether :func:`scaled_mm_accumulate_` serves ``out [m, n] += a [m, k] @ b_t [n, k].T`` (see the module)."""
    return _served_plan(out, a, b_t) is not None


def scaled_mm_accumulate_(out: torch.Tensor, a: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor,
                          b_scale_inv: torch.Tensor) -> bool:
    """``out += (a * a_scale_inv) @ (b_t * b_scale_inv).T`` in one cuBLASLt GEMM, for float8 ``a [m, k]`` and
    ``b_t [n, k]`` with per-tensor fp32 dequantization factors (one-element CUDA tensors, as ``torch._scaled_mm``'s
    ``scale_a`` / ``scale_b``). Returns False, leaving ``out`` untouched, where :func:`accumulates` does not hold."""
    served = _served_plan(out, a, b_t)
    if served is None:
        return False
    plan, workspace = served
    a_scale_inv, b_scale_inv = a_scale_inv.float().contiguous(), b_scale_inv.float().contiguous()
    plan.run(out, a, a_scale_inv, b_t, b_scale_inv, workspace, torch.cuda.current_stream(out.device).cuda_stream)
    return True
