"""A float8 GEMM that accumulates into its output: the weight gradient of an FP8 layer added to ``main_grad``.

``torch._scaled_mm`` writes a new tensor; adding it into ``main_grad`` afterwards reads and writes the whole weight
gradient twice more (a bandwidth-bound add per weight and micro-batch, 15 ms of a 3B-class step on an H200).
Megatron-Core's fused weight-gradient accumulation avoids that pass with cuBLAS's ``beta = 1``; this Triton kernel
does the same for the float8 operands: ``c += (a / a_scale) @ (b / b_scale).T`` for ``a [M, K]`` and ``b [N, K]``
(e4m3 or e5m2, both contiguous along the reduction dimension, the layout Hopper's float8 tensor cores read) and ``c [M, N]`` in
bf16, fp16 or fp32, accumulated in fp32 and rounded once. :func:`fp8_gemm_accumulate` is a ``torch.library``
``triton_op``, traced as it is by ``torch.compile``; :func:`accumulate_kernel_serves` says where it runs (CUDA,
Triton present, compute capability 8.9 or newer).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules, triton_op

__all__ = ["accumulate_kernel_serves", "fp8_gemm_accumulate"]

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): tiles for Hopper's float8 wgmma, chosen once per shape by timing.
_CONFIGS = ((128, 256, 128, 8, 3), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3), (128, 256, 64, 8, 4),
            (128, 128, 64, 4, 5))
_GROUP_M = 8  # row blocks per group of the launch order (L2 reuse of the column operand)


def accumulate_kernel_serves(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`fp8_gemm_accumulate` can add ``a @ b.T`` into ``c``: contiguous CUDA tensors, float8 operands of
    e4m3 or e5m2, ``c`` in bf16 / fp16 / fp32, Triton installed, compute capability >= 8.9."""
    if not (c.is_cuda and a.is_cuda and b.is_cuda) or _ACCUMULATE_OP is None or not have_triton():
        return False
    float8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if c.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a.dtype not in float8 or b.dtype not in float8:
        return False
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()):
        return False
    return torch.cuda.get_device_capability(c.device) >= (8, 9)


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()
    configs = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
               for bm, bn, bk, w, s in _CONFIGS]

    @triton.autotune(configs=configs, key=["M", "N", "K"], reset_to_zero=None, restore_value=["c_ptr"])
    @triton.jit
    def accumulate_kernel(a_ptr, b_ptr, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_rows = tl.max_contiguous(tl.multiple_of(rm % M, BM), BM).to(tl.int64)
        b_rows = tl.max_contiguous(tl.multiple_of(rn % N, BN), BN).to(tl.int64)
        a_ptrs = a_ptr + a_rows[:, None] * K + rk[None, :]
        b_ptrs = b_ptr + b_rows[:, None] * K + rk[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            k_ok = rk[None, :] < K - k * BK
            a = tl.load(a_ptrs, mask=k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=k_ok, other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
            a_ptrs += BK
            b_ptrs += BK
        acc = acc * (1.0 / tl.load(a_scale_ptr)) * (1.0 / tl.load(b_scale_ptr))
        offsets = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        old = tl.load(c_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + offsets, (old + acc).to(c_ptr.dtype.element_ty), mask=mask)

    return accumulate_kernel


def _accumulate(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor,
                b_scale: torch.Tensor) -> None:
    (m, k), n = a.shape, b.shape[0]
    kernel = _kernel()

    def grid(meta: dict) -> tuple[int]:
        return (-(-m // meta["BM"]) * -(-n // meta["BN"]),)

    torch.library.wrap_triton(kernel)[grid](a, b, c, a_scale, b_scale, m, n, k, GROUP_M=_GROUP_M)


_ACCUMULATE_OP = triton_op("megatron_core::fp8_gemm_accumulate_", _accumulate, mutates_args=("c",))


def fp8_gemm_accumulate(c: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor) -> None:
    """``c += (a / a_scale) @ (b / b_scale).T`` for contiguous float8 ``a [M, K]``, ``b [N, K]`` and ``c [M, N]``
    (one-element fp32 scales), accumulated in fp32 (see :func:`accumulate_kernel_serves`)."""
    if a.shape[1] != b.shape[1] or c.shape != (a.shape[0], b.shape[0]):
        raise ValueError(f"fp8_gemm_accumulate: c {tuple(c.shape)} += a {tuple(a.shape)} @ b {tuple(b.shape)}.T "
                         "needs a [M, K], b [N, K], c [M, N]")
    _ACCUMULATE_OP(c, a, b, a_scale.float().reshape(1), b_scale.float().reshape(1))
