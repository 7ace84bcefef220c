"""A float8 GEMM that accumulates into its output: the weight gradient of an FP8 layer added to ``main_grad``.

``torch._scaled_mm`` writes a new tensor; adding it into ``main_grad`` afterwards reads and writes the whole weight
gradient twice more (a bandwidth-bound add per weight and micro-batch, 15 ms of a 3B-class step on an H200).
Megatron-Core's fused weight-gradient accumulation avoids that pass with cuBLAS's ``beta = 1``; this Triton kernel
does the same for the float8 operands: ``c += (a / a_scale) @ (b / b_scale).T`` for ``a [M, K]`` and ``b [N, K]``
(e4m3 or e5m2, both contiguous along the reduction dimension, the layout Hopper's float8 tensor cores read) and ``c [M, N]`` in
bf16, fp16 or fp32, accumulated in fp32 and rounded once. The operand tiles come through Hopper's tensor memory
accelerator (Triton's ``TensorDescriptor``); the tile shape is chosen per GEMM shape by timing. On an H200 (3B-class
layer, 4096 tokens, ``benchmarks/fp8_wgrad_gemm.py``) it took 712 us per layer's four weight gradients where
``_scaled_mm`` and the add took 822 us. It is launched directly (the weight-gradient op that calls it is opaque to
``torch.compile``); :func:`accumulate_kernel_serves` says where it runs (CUDA, compute capability 9.0 or newer, a
Triton with tensor descriptors, operands aligned as the descriptors need).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, triton_modules

__all__ = ["accumulate_kernel_serves", "fp8_gemm_accumulate"]

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): tiles for Hopper's float8 wgmma, chosen once per shape by timing.
_CONFIGS = ((128, 256, 64, 8, 4), (256, 128, 128, 8, 3), (128, 256, 128, 8, 3), (128, 128, 128, 8, 4))
_GROUP_M = 8  # row blocks per group of the launch order (L2 reuse of the column operand)
_ALIGN = 16  # bytes: a tensor descriptor's base address and row pitch


@functools.cache
def _tensor_descriptor() -> Any:
    """Triton's host-side ``TensorDescriptor`` class, or ``None`` where this Triton lacks it."""
    if not have_triton():
        return None
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        return None
    return TensorDescriptor


def accumulate_kernel_serves(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`fp8_gemm_accumulate` can add ``a @ b.T`` into ``c``: contiguous CUDA tensors, float8 operands
    (e4m3 or e5m2) whose rows and base addresses are 16-byte aligned, ``c`` in bf16 / fp16 / fp32, compute
    capability >= 9.0, a Triton with tensor descriptors."""
    float8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    if not (c.is_cuda and a.is_cuda and b.is_cuda) or a.dtype not in float8 or b.dtype not in float8:
        return False
    if c.dtype not in (torch.bfloat16, torch.float16, torch.float32) or a.dim() != 2 or b.dim() != 2:
        return False
    if not (a.is_contiguous() and b.is_contiguous() and c.is_contiguous()) or a.shape[1] % _ALIGN:
        return False
    if a.data_ptr() % _ALIGN or b.data_ptr() % _ALIGN:
        return False
    return torch.cuda.get_device_capability(c.device) >= (9, 0) and _tensor_descriptor() is not None


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()
    configs = [triton.Config({"BM": bm, "BN": bn, "BK": bk}, num_warps=w, num_stages=s)
               for bm, bn, bk, w, s in _CONFIGS]

    def set_blocks(args: dict) -> None:  # the descriptors' tile shapes follow the chosen config
        args["a_desc"].block_shape = [args["BM"], args["BK"]]
        args["b_desc"].block_shape = [args["BN"], args["BK"]]

    configs = [triton.Config(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages, pre_hook=set_blocks)
               for c in configs]

    @triton.autotune(configs=configs, key=["M", "N", "K"], restore_value=["c_ptr"])
    @triton.jit
    def accumulate_kernel(a_desc, b_desc, c_ptr, a_scale_ptr, b_scale_ptr, M, N, K,
                          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
        pid = tl.program_id(0)
        blocks_m, blocks_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
        per_group = GROUP_M * blocks_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):  # pipelined over the config's stages; out-of-range tiles read zeros
            a = a_desc.load([pid_m * BM, k * BK])
            b = b_desc.load([pid_n * BN, k * BK])
            # Each BK-long partial product is added to the fp32 sum: the float8 tensor cores' own accumulator keeps
            # fewer bits (Triton's default accumulates the whole K there), so this promotes it every BK elements
            # as cuBLAS's non-fast accumulation does (every 128).
            acc += tl.dot(a, b.T)
        acc = acc * (1.0 / tl.load(a_scale_ptr)) * (1.0 / tl.load(b_scale_ptr))
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        offsets = rm.to(tl.int64)[:, None] * N + rn[None, :]
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        old = tl.load(c_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        tl.store(c_ptr + offsets, (old + acc).to(c_ptr.dtype.element_ty), mask=mask)

    return accumulate_kernel


def fp8_gemm_accumulate(c: torch.Tensor, a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor,
                        b_scale: torch.Tensor) -> None:
    """``c += (a / a_scale) @ (b / b_scale).T`` for contiguous float8 ``a [M, K]``, ``b [N, K]`` and ``c [M, N]``
    (one-element fp32 scales), accumulated in fp32 (see :func:`accumulate_kernel_serves`)."""
    if a.shape[1] != b.shape[1] or c.shape != (a.shape[0], b.shape[0]):
        raise ValueError(f"fp8_gemm_accumulate: c {tuple(c.shape)} += a {tuple(a.shape)} @ b {tuple(b.shape)}.T "
                         "needs a [M, K], b [N, K], c [M, N]")
    (m, k), n = a.shape, b.shape[0]
    descriptor = _tensor_descriptor()
    first = _CONFIGS[0]  # placeholder tile shapes; each config's pre-hook sets its own
    a_desc = descriptor.from_tensor(a, [first[0], first[2]])
    b_desc = descriptor.from_tensor(b, [first[1], first[2]])

    def grid(meta: dict) -> tuple[int]:
        return (-(-m // meta["BM"]) * -(-n // meta["BN"]),)

    with torch.cuda.device(c.device):
        _kernel()[grid](a_desc, b_desc, c, a_scale.float().reshape(1), b_scale.float().reshape(1), m, n, k,
                        GROUP_M=_GROUP_M)
