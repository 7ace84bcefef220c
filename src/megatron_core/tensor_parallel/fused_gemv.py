"""A linear layer over one row (a decode step at batch 1), with its neighbours fused in (Triton, CUDA only).

With one row of input a linear layer reads its whole weight for very little arithmetic: its time is
the weight's bytes over the memory bandwidth, plus a fixed cost per kernel. cuBLAS streams the small
matrices of a decode step at 45-65% of the copy bandwidth (a 2048 x 2048 projection is 8 MB, a few
microseconds), and the elementwise kernels around each GEMV (RMSNorm, residual add, SwiGLU) each add
a launch. :func:`fused_gemv` streams ``BLOCK_N`` whole weight rows per program (about 60-100% of the
copy bandwidth on an H100; the tile depends on what is fused in) and optionally folds in

- an **RMSNorm prologue** (``norm_weight``): ``x`` is normalised on the fly. The sum of squares is
  accumulated in the same pass as the products (every program reads all of ``x``), and the row's
  scale ``rsqrt(mean(x^2) + eps)`` multiplies the finished dot products, so there is no second pass;
- a **gated SiLU epilogue** (``gated_silu``): the weight is ``[gate; up]`` (``2F`` rows, the layout of a
  gated MLP's ``linear_fc1``) and the output is ``silu(x W_gate^T) * (x W_up^T)`` (``F`` values);
- a **bias** and a **residual** added to the output.

Products accumulate in fp32; the linear's output is rounded to the input's dtype before the epilogue,
as the unfused layers round it. The normalised input is not rounded (it never exists), so results
differ from the unfused chain by bf16 rounding only.

:func:`fused_gemv_supported` says when the kernel applies; under ``torch.compile`` the kernel is an
opaque custom op (``torch.ops.megatron_core.fused_gemv``). Triton is imported lazily (:mod:`megatron_core.jit`).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules

__all__ = ["fused_gemv", "fused_gemv_reference", "fused_gemv_supported"]


def _tile(norm: bool, gated: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_N, BLOCK_K, warps, stages)``: one program streams ``BLOCK_N`` whole weight rows (twice that when
    gated), ``BLOCK_K`` columns at a time. The fastest tiles of each variant on the decode-step shapes of a 1.1B
    Llama, measured on an H100 (benchmarks/RESULTS.md, session 10): a norm prologue wants more rows per program
    (every program reads all of ``x`` and the norm weight), a gated weight one row pair."""
    if gated:
        return 1, 1024, 4, 3
    if norm:
        return 8, 1024, 8, 1
    return 2, 1024, 4, 1


def fused_gemv_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`fused_gemv` serves ``x @ weight^T``: one row, CUDA, fp16/bf16, contiguous weight, no grad."""
    # The row count first: every linear layer asks, and in training it is never one.
    return (x.numel() == x.shape[-1] and x.is_cuda and x.dtype in (torch.float16, torch.bfloat16)
            and weight.dtype == x.dtype and weight.is_cuda and weight.dim() == 2 and weight.shape[1] == x.shape[-1]
            and weight.is_contiguous() and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            and have_triton())


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def fused_gemv_kernel(
        x_ptr, w_ptr, b_ptr, g_ptr, r_ptr, y_ptr, N, K, stride_wn, eps,
        HAS_BIAS: tl.constexpr, HAS_NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr, GATED: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        n_ok = rn < N
        rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
        up_rows = w_ptr + (rn[:, None] + N).to(tl.int64) * stride_wn  # the up half of a gated weight
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            if EVEN_K:
                x = tl.load(x_ptr + k).to(tl.float32)
                w_mask = n_ok[:, None]
            else:
                k_ok = k < K
                x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                w_mask = n_ok[:, None] & k_ok[None, :]
            if HAS_NORM:
                squares += x * x
                if EVEN_K:
                    x = x * tl.load(g_ptr + k).to(tl.float32)
                else:
                    x = x * tl.load(g_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            acc += tl.load(rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x[None, :]
            if GATED:
                acc_up += tl.load(up_rows + k[None, :], mask=w_mask, other=0.0).to(tl.float32) * x[None, :]
        out = tl.sum(acc, axis=1)
        if GATED:
            up = tl.sum(acc_up, axis=1)
        if HAS_NORM:
            scale = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
            out = out * scale
            if GATED:
                up = up * scale
        dtype = y_ptr.dtype.element_ty
        if HAS_BIAS:
            out = out + tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
            if GATED:
                up = up + tl.load(b_ptr + N + rn, mask=n_ok, other=0.0).to(tl.float32)
        out = out.to(dtype).to(tl.float32)  # the linear's output as the unfused layer stores it
        if GATED:
            up = up.to(dtype).to(tl.float32)
            out = out / (1.0 + tl.exp(-out)) * up
        if HAS_RESIDUAL:
            out = out + tl.load(r_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, out.to(dtype), mask=n_ok)

    return fused_gemv_kernel


def _out_features(weight: torch.Tensor, gated_silu: bool) -> int:
    rows = weight.shape[0]
    if gated_silu and rows % 2:
        raise ValueError(f"fused_gemv: a gated weight needs an even number of rows, got {tuple(weight.shape)}")
    return rows // 2 if gated_silu else rows


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
           residual: torch.Tensor | None, n: int) -> None:
    k = weight.shape[1]
    if x.shape[-1] != k:
        raise ValueError(f"fused_gemv: input has {x.shape[-1]} features, weight is {tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ValueError(f"fused_gemv: the weight's rows must be contiguous, got strides {weight.stride()}")
    for name, tensor, size in (("bias", bias, weight.shape[0]), ("norm_weight", norm_weight, k), ("residual", residual, n)):
        if tensor is not None and tensor.numel() != size:
            raise ValueError(f"fused_gemv: {name} has {tensor.numel()} elements, expected {size}")


def _fused_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, norm_weight: torch.Tensor | None,
                norm_eps: float, residual: torch.Tensor | None, gated_silu: bool,
                tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    n = _out_features(weight, gated_silu)
    _check(x, weight, bias, norm_weight, residual, n)
    k = weight.shape[1]
    block_n, block_k, warps, stages = tile or _tile(norm_weight is not None, gated_silu)
    x = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _kernel()[(-(-n // block_n),)](
        x, weight, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        residual.contiguous() if residual is not None else x, out, n, k, weight.stride(0), float(norm_eps),
        HAS_BIAS=bias is not None, HAS_NORM=norm_weight is not None, HAS_RESIDUAL=residual is not None,
        GATED=gated_silu, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
        num_stages=stages,
    )
    return out


@torch.library.custom_op("megatron_core::fused_gemv", mutates_args=())
def _fused_gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, norm_eps: float, residual: torch.Tensor | None,
                   gated_silu: bool) -> torch.Tensor:
    return _fused_gemv(x, weight, bias, norm_weight, norm_eps, residual, gated_silu)


@_fused_gemv_op.register_fake
def _fused_gemv_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     norm_weight: torch.Tensor | None, norm_eps: float, residual: torch.Tensor | None,
                     gated_silu: bool) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], _out_features(weight, gated_silu))


def fused_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
               norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
               residual: torch.Tensor | None = None, gated_silu: bool = False) -> torch.Tensor:
    """``epilogue(rmsnorm(x) @ weight^T + bias) + residual`` for one row ``x [..., K]`` (see the module doc).

    Check :func:`fused_gemv_supported` first. ``norm_weight [K]``: RMSNorm ``x`` first (scale
    ``norm_weight``, ``norm_eps``). ``gated_silu``: ``weight [2F, K]`` is ``[gate; up]`` and the result
    is ``silu(gate) * up`` (``bias [2F]`` applies before the gate). ``residual`` (output-sized) is added last.
    """
    if torch.compiler.is_compiling():
        return torch.ops.megatron_core.fused_gemv(x, weight, bias, norm_weight, norm_eps, residual, gated_silu)
    return _fused_gemv(x, weight, bias, norm_weight, norm_eps, residual, gated_silu)


def fused_gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                         norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-5,
                         residual: torch.Tensor | None = None, gated_silu: bool = False) -> torch.Tensor:
    """The unfused chain :func:`fused_gemv` computes (any device and dtype; for tests)."""
    if norm_weight is not None:
        x = torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight, norm_eps)
    out = torch.nn.functional.linear(x, weight, bias)
    if gated_silu:
        gate, up = torch.chunk(out, 2, dim=-1)
        out = torch.nn.functional.silu(gate) * up
    return out if residual is None else out + residual.view(out.shape)
