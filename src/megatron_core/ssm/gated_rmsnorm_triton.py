"""The Mamba mixer's gated group RMSNorm (``ExtendedRMSNorm(y, z)``) as one Triton kernel, for inference.

``weight * rms_norm_per_group(y * silu(z))`` (or, with ``norm_before_gate``, the gate after the normalisation) is
about ten element-wise and reduction kernels in eager PyTorch; in a decode step of a few rows each costs about as
much to launch as to run. Here one program per ``(row, group)`` reads the group's ``y`` and ``z`` once and writes
the result, fp32 inside, in ``y``'s dtype. :class:`~megatron_core.ssm.mamba_mixer.ExtendedRMSNorm` stays the
reference and the CPU path. Under ``torch.compile`` it is a custom op, so a compiled graph keeps it whole.
Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, next_power_of_two, triton_modules

__all__ = ["gated_rmsnorm", "gated_rmsnorm_supported"]

_MAX_GROUP = 8192  # the largest group one program holds


def gated_rmsnorm_supported(y: torch.Tensor, z: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`gated_rmsnorm` serves these tensors: CUDA, 2-D with unit last strides, a floating dtype,
    groups of at most 8192 channels, Triton installed."""
    return (y.is_cuda and z.is_cuda and y.dim() == 2 and z.dim() == 2 and y.stride(-1) == 1 and z.stride(-1) == 1
            and y.dtype in (torch.float32, torch.bfloat16, torch.float16) and group_size <= _MAX_GROUP
            and have_triton())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def gated_rmsnorm_kernel(y_ptr, z_ptr, w_ptr, out_ptr, group_size, eps, s_yr, s_zr, s_or,
                             BG: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * group_size + tl.arange(0, BG)
        ok = tl.arange(0, BG) < group_size
        h = tl.load(y_ptr + row * s_yr + cols, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + row * s_zr + cols, mask=ok, other=0.0).to(tl.float32)
        gate = z / (1.0 + tl.exp(-z))
        if not NORM_BEFORE_GATE:
            h = h * gate
        h = h * tl.rsqrt(tl.sum(h * h, 0) / group_size + eps)
        if NORM_BEFORE_GATE:
            h = h * gate
        h = h * tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * s_or + cols, h.to(out_ptr.dtype.element_ty), mask=ok)

    return gated_rmsnorm_kernel


def _gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                   norm_before_gate: bool) -> torch.Tensor:
    out = torch.empty(y.shape, device=y.device, dtype=y.dtype)
    block = next_power_of_two(group_size)  # one group per program; more warps for wide groups (registers)
    if y.shape[0]:
        _kernel()[(y.shape[0], y.shape[1] // group_size)](
            y, z, weight, out, group_size, eps, y.stride(0), z.stride(0), out.stride(0),
            BG=block, NORM_BEFORE_GATE=norm_before_gate, num_warps=min(16, max(4, block // 512)))
    return out


@torch.library.custom_op("megatron_core::gated_rmsnorm", mutates_args=())
def _gated_rmsnorm_op(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                      norm_before_gate: bool) -> torch.Tensor:
    return _gated_rmsnorm(y, z, weight, eps, group_size, norm_before_gate)


@_gated_rmsnorm_op.register_fake
def _gated_rmsnorm_fake(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                        norm_before_gate: bool) -> torch.Tensor:
    return torch.empty(y.shape, device=y.device, dtype=y.dtype)


def gated_rmsnorm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, group_size: int,
                  norm_before_gate: bool = False) -> torch.Tensor:
    """``weight * rms_norm_per_group(y * silu(z))`` (the gate after the norm with ``norm_before_gate``) of ``y``
    and ``z`` ``[rows, d]`` (unit last strides; ``d`` a multiple of ``group_size``), ``weight`` ``[d]``; in
    ``y``'s dtype. Check :func:`gated_rmsnorm_supported` first."""
    if y.shape[1] % group_size != 0:
        raise ValueError(f"gated_rmsnorm: width {y.shape[1]} is not a multiple of group_size {group_size}")
    args = (y, z, weight.contiguous(), float(eps), int(group_size), bool(norm_before_gate))
    if torch.compiler.is_compiling():
        return torch.ops.megatron_core.gated_rmsnorm(*args)
    return _gated_rmsnorm(*args)
