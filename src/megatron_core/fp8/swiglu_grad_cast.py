"""SwiGLU's backward fused with the float8 cast of its result, for an FP8-parameter ``linear_fc1`` (CUDA, Triton).

An FP8 ``linear_fc1`` quantizes its output gradient ``dy = swiglu_grad(g, y)`` (``y = [gate; up]``, the GEMM's
output) with a per-tensor scale from ``dy``'s current amax, then writes ``dy``'s codes row-major (the data
gradient's operand) and transposed (the weight gradient's). Compiled, that is a reduction kernel that makes ``dy``
and its amax (Inductor lowers the two halves' ``cat`` to masked loads of both halves for every element: about half
the memory bandwidth) and a kernel that casts ``dy``. Here ``dy`` is never stored in bf16:

- :func:`swiglu_grad_amax`: one pass over ``g`` and ``y`` for ``dy``'s amax (each program's maximum combined by
  an atomic maximum);
- :func:`swiglu_grad_cast_transpose`: ``dy`` recomputed tile by tile and cast with the agreed scale, written as
  the codes ``[T, 2F]`` and their transposed copy ``[2F, T16]`` (rows zero-padded to a multiple of 16), as
  :func:`megatron_core.fp8.cast_kernels.cast_transpose` writes them.

Each program loads a tile of ``g``, ``gate`` and ``up`` once and derives both halves of ``dy`` from it. ``dy`` is
rounded to ``y``'s dtype before its amax and its cast, so both equal the unfused path's on the same ``dy``;
:func:`swiglu_grad` is the formula (in fp32), the reference and the path off CUDA. The ops are opaque to
``torch.compile`` (as ``fp8_cast_transpose``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.activations import gated_linear_unit
from megatron_core.distributed.fp8_params import fp8_max
from megatron_core.fp8.cast_kernels import codes_and_transposed
from megatron_core.fusions.fused_bias_swiglu import swiglu_back
from megatron_core.jit import have_triton, kernel_device, triton_modules

__all__ = ["swiglu", "swiglu_grad", "swiglu_grad_amax", "swiglu_grad_cast_serves", "swiglu_grad_cast_transpose"]

_CONFIGS = ((64, 64, 4), (64, 128, 4), (128, 64, 4), (32, 128, 4), (64, 256, 8))  # rows, columns, warps per program


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``y = [gate; up]`` along the last dimension (the MLP's ``gated_linear_unit``)."""
    return gated_linear_unit(y, torch.nn.functional.silu)


def swiglu_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`swiglu` at ``y`` times ``g`` (``fused_bias_swiglu.swiglu_back``), computed in fp32 and
    rounded to ``y``'s dtype, as the kernels round it."""
    return swiglu_back(g.float(), y.float()).to(y.dtype)


def swiglu_grad_cast_serves(g: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``g [T, F]`` and ``y [T, 2F]``: contiguous 2-D CUDA tensors of one dtype,
    Triton present."""
    return (g.dim() == 2 and y.dim() == 2 and g.is_cuda and y.is_cuda and g.is_contiguous() and y.is_contiguous()
            and g.dtype == y.dtype and y.shape == (g.shape[0], 2 * g.shape[1]) and have_triton())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()
    configs = [triton.Config({"BR": r, "BC": c}, num_warps=w) for r, c, w in _CONFIGS]

    @triton.autotune(configs=configs, key=["rows", "half", "AMAX", "E5M2"])
    @triton.jit
    def swiglu_grad_kernel(g_ptr, y_ptr, scale_ptr, amax_ptr, q_ptr, qt_ptr, rows, half, padded_rows, limit,
                           AMAX: tl.constexpr, E5M2: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
        # AMAX: max-combine the tile's amax into amax_ptr; else cast the tile, written row-major and transposed
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        c_ok = (c < half)[None, :]
        ok = (r < rows)[:, None] & c_ok
        row = r.to(tl.int64)[:, None]
        g = tl.load(g_ptr + row * half + c[None, :], mask=ok, other=0.0).to(tl.float32)
        gate = tl.load(y_ptr + row * (2 * half) + c[None, :], mask=ok, other=0.0)
        up = tl.load(y_ptr + row * (2 * half) + half + c[None, :], mask=ok, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = up.to(tl.float32)
        sig = tl.sigmoid(gate)
        d_gate = (g * sig * (1.0 + gate * (1.0 - sig)) * up).to(dtype).to(tl.float32)
        d_up = (g * gate * sig).to(dtype).to(tl.float32)
        if AMAX:
            tile_max = tl.maximum(tl.max(tl.max(tl.abs(d_gate), axis=1), axis=0),
                                  tl.max(tl.max(tl.abs(d_up), axis=1), axis=0))
            tl.atomic_max(amax_ptr, tile_max)
        else:
            scale = tl.load(scale_ptr)
            d_gate = tl.clamp(d_gate * scale, -limit, limit)
            d_up = tl.clamp(d_up * scale, -limit, limit)
            q_gate = d_gate.to(tl.float8e5) if E5M2 else d_gate.to(tl.float8e4nv)
            q_up = d_up.to(tl.float8e5) if E5M2 else d_up.to(tl.float8e4nv)
            tl.store(q_ptr + row * (2 * half) + c[None, :], q_gate, mask=ok)
            tl.store(q_ptr + row * (2 * half) + half + c[None, :], q_up, mask=ok)
            padded_ok = tl.trans((r < padded_rows)[:, None] & c_ok)  # the transposed copy's padding rows: zeros
            col = c.to(tl.int64)[:, None] * padded_rows + r[None, :]
            tl.store(qt_ptr + col, tl.trans(q_gate), mask=padded_ok)
            tl.store(qt_ptr + col + half * padded_rows, tl.trans(q_up), mask=padded_ok)

    return swiglu_grad_kernel


def _launch(g: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, codes: torch.Tensor,
            transposed: torch.Tensor, amax_pass: bool, e5m2: bool) -> None:
    rows, half = g.shape
    padded = rows if amax_pass else transposed.shape[1]  # the cast pass also writes the padding rows' zeros

    def grid(meta: dict) -> tuple[int, int]:
        return (-(-padded // meta["BR"]), -(-half // meta["BC"]))

    limit = fp8_max(torch.float8_e5m2 if e5m2 else torch.float8_e4m3fn)
    with kernel_device(g):
        _kernel()[grid](g, y, scale, amax, codes, transposed, rows, half, padded, limit, AMAX=amax_pass, E5M2=e5m2)


def _amax(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    amax = torch.zeros((), dtype=torch.float32, device=g.device)
    unused = g.new_empty(0, dtype=torch.float8_e4m3fn)  # the cast's outputs, not written by the amax pass
    _launch(g, y, amax, amax, unused, unused, amax_pass=True, e5m2=False)
    return amax


def _cast(g: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    codes, transposed = codes_and_transposed(g, g.shape[0], 2 * g.shape[1], e5m2)
    _launch(g, y, scale, scale, codes, transposed, amax_pass=False, e5m2=e5m2)
    return codes, transposed


_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("fp8_swiglu_grad_amax(Tensor g, Tensor y) -> Tensor")
_LIBRARY.impl("fp8_swiglu_grad_amax", _amax, "CUDA")
_LIBRARY.define("fp8_swiglu_grad_cast_transpose(Tensor g, Tensor y, Tensor scale, bool e5m2) -> (Tensor, Tensor)")
_LIBRARY.impl("fp8_swiglu_grad_cast_transpose", _cast, "CUDA")


@torch.library.register_fake("megatron_core::fp8_swiglu_grad_amax", lib=_LIBRARY)
def _(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return g.new_empty((), dtype=torch.float32)


@torch.library.register_fake("megatron_core::fp8_swiglu_grad_cast_transpose", lib=_LIBRARY)
def _(g: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, e5m2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return codes_and_transposed(g, g.shape[0], 2 * g.shape[1], e5m2)


def swiglu_grad_amax(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The amax (a 0-d fp32 tensor, as ``Tensor.amax()``) of ``swiglu_grad(g, y)`` (see :func:`swiglu_grad_cast_serves`)."""
    return torch.ops.megatron_core.fp8_swiglu_grad_amax(g, y)


def swiglu_grad_cast_transpose(g: torch.Tensor, y: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``swiglu_grad(g, y)`` times the one-element fp32 ``scale``, saturated and cast to float8 ``dtype``: codes
    ``[T, 2F]`` and their transposed copy ``[2F, T16]`` (columns past ``T`` zeros), as ``cast_transpose``."""
    if dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"swiglu_grad_cast_transpose: dtype {dtype} is not float8_e4m3fn or float8_e5m2")
    return torch.ops.megatron_core.fp8_swiglu_grad_cast_transpose(g, y, scale.float().reshape(1),
                                                                  dtype == torch.float8_e5m2)
