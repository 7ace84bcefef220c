"""SwiGLU's output and its amax in one pass (CUDA, Triton), for an FP8 ``linear_fc2`` fed by an FP8 ``linear_fc1``.

An FP8 ``linear_fc2`` quantizes its input, SwiGLU's output ``h = silu(gate) * up``, with a per-tensor scale from
``h``'s current amax. Compiled, that is a pointwise kernel writing ``h`` and a split reduction reading all of ``h``
again for the amax (Inductor does not fuse a whole-tensor reduction into its producer: the loop shapes differ).
:func:`swiglu_with_amax` writes ``h`` and combines each tile's maximum with an atomic maximum in the same pass, and
``Float8ParamMatmul`` hands the amax to ``linear_fc2``'s GEMM (``x_amax``). ``h`` is rounded to ``y``'s dtype before
its amax, so the amax is the one ``linear_fc2`` would compute from ``h``. The kernel serves traced code
(``torch.compile``, and the CUDA graphs of compiled layers), where it replaces what Inductor would generate: both
compute ``silu(gate) * up`` in fp32 and round once. Eagerly (and off CUDA, or without Triton) the same function
runs as PyTorch ops, which round ``silu(gate)`` to ``y``'s dtype before the product, as the MLP's own SwiGLU does
(numbers unchanged for eager runs). The op is opaque to ``torch.compile`` (as ``fp8_swiglu_grad_amax``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.distributed.fp8_params import amax_or_zero
from megatron_core.fp8.swiglu_grad_cast import swiglu
from megatron_core.jit import have_triton, kernel_device, triton_modules

__all__ = ["swiglu_with_amax"]

_CONFIGS = ((32, 256, 4), (64, 128, 4), (16, 512, 4), (64, 256, 8))  # rows, columns, warps per program


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()
    configs = [triton.Config({"BR": r, "BC": c}, num_warps=w) for r, c, w in _CONFIGS]

    @triton.autotune(configs=configs, key=["rows", "half"])
    @triton.jit
    def swiglu_amax_kernel(y_ptr, h_ptr, amax_ptr, rows, half, BR: tl.constexpr, BC: tl.constexpr):
        # h = silu(gate) * up for y = [gate; up], stored in y's dtype; the tile's amax max-combined into amax_ptr
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        ok = (r < rows)[:, None] & (c < half)[None, :]
        row = r.to(tl.int64)[:, None]
        gate = tl.load(y_ptr + row * (2 * half) + c[None, :], mask=ok, other=0.0)
        up = tl.load(y_ptr + row * (2 * half) + half + c[None, :], mask=ok, other=0.0)
        gate32 = gate.to(tl.float32)
        h = (gate32 * tl.sigmoid(gate32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(h_ptr + row * half + c[None, :], h, mask=ok)
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(h.to(tl.float32)), axis=1), axis=0))

    return swiglu_amax_kernel


def _swiglu_amax(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, half = y.shape[0], y.shape[1] // 2
    h = y.new_empty(rows, half)
    amax = torch.zeros((), dtype=torch.float32, device=y.device)

    def grid(meta: dict) -> tuple[int, int]:
        return (-(-rows // meta["BR"]), -(-half // meta["BC"]))

    with kernel_device(y):
        _kernel()[grid](y, h, amax, rows, half)
    return h, amax


_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("fp8_swiglu_amax(Tensor y) -> (Tensor, Tensor)")
_LIBRARY.impl("fp8_swiglu_amax", _swiglu_amax, "CUDA")


@torch.library.register_fake("megatron_core::fp8_swiglu_amax", lib=_LIBRARY)
def _(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return y.new_empty(y.shape[0], y.shape[1] // 2), y.new_empty((), dtype=torch.float32)


def _fused_serves(y: torch.Tensor) -> bool:
    return (y.dim() == 2 and y.is_cuda and y.is_contiguous() and y.shape[1] % 2 == 0
            and y.dtype in (torch.bfloat16, torch.float16, torch.float32) and have_triton())


def swiglu_with_amax(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, amax)``: ``h = swiglu(y)`` (``[T, F]`` of ``y = [gate; up]`` ``[T, 2F]``, in ``y``'s dtype) and
    ``h.abs().amax()`` as a 0-d fp32 tensor; one Triton pass in traced code on CUDA for a contiguous 2-D ``y``
    (see the module)."""
    if torch.compiler.is_compiling() and _fused_serves(y):
        return torch.ops.megatron_core.fp8_swiglu_amax(y)
    h = swiglu(y)
    return h, amax_or_zero(h)
