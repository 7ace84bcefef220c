"""The experts' FP8 weight-gradient grouped GEMM that adds its result into ``main_grad`` (a Triton kernel).

``main_grad[e] += (dy_e.T @ x_e) * dy_scale[e, :, None] * x_scale[e, None, :]`` for every expert ``e``: the
operands are the transposed e4m3 codes the column-wise casts of :mod:`megatron_core.fp8.cast_kernels` write
(``dy.T`` ``[out, M]`` and ``x.T`` ``[in, M]``, each expert's tokens a run of columns ending at ``ends[e]``) with
their dequantizing scales ``[E * out]`` and ``[E * in]``. ``torch._scaled_grouped_mm`` writes ``dW`` in bf16 and a
separate kernel adds it to the fp32 ``main_grad``; here the product is accumulated in fp32 and added in the GEMM's
epilogue (as Transformer Engine's grouped GEMM accumulates into ``main_grad``): one read and one write of
``main_grad``, no bf16 ``dW`` and no rounding of it.

Programs: one per ``(out tile, in tile)`` of one expert; each walks that expert's tokens in ``BK`` steps (an
expert with no tokens adds nothing). Block shapes are :data:`WGRAD_BLOCKS`. Registered as the custom op
``megatron_core::fp8_grouped_wgrad_accumulate_`` (mutates ``main_grad``; traceable by ``torch.compile``).
Triton is loaded through :mod:`megatron_core.jit` only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from megatron_core.jit import have_triton, kernel_device, triton_modules, triton_op

__all__ = ["WGRAD_BLOCKS", "grouped_wgrad_accumulate_", "grouped_wgrad_accumulate_supported"]

# Tile of main_grad per program (BM output features x BN input features), BK tokens per step, warps and stages:
# the largest tiles that compile for sm_90 without spilling (benchmarks/triton_resources.py; not yet timed on a GPU).
WGRAD_BLOCKS: dict[str, int] = {"BM": 128, "BN": 128, "BK": 128, "warps": 8, "stages": 2}


@functools.cache
def _kernel() -> Any:
    triton, tl = triton_modules()

    @triton.jit
    def fp8_grouped_wgrad_accumulate_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, ends_ptr, out_ptr,
                                            tokens, out_features, in_features,
                                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        # out[e, m, n] += sum over the expert's tokens k of a[m, k] b[n, k], times a_scale[e, m] b_scale[e, n].
        tiles_n = tl.cdiv(in_features, BN)
        m = (tl.program_id(0) // tiles_n) * BM + tl.arange(0, BM)
        n = (tl.program_id(0) % tiles_n) * BN + tl.arange(0, BN)
        e = tl.program_id(1)
        # Group ends are multiples of 16 tokens: the hint lets each thread load 16 contiguous bytes at a time.
        start = tl.multiple_of(tl.load(ends_ptr + e - 1, mask=e > 0, other=0), 16)
        end = tl.multiple_of(tl.load(ends_ptr + e), 16)
        ks = tl.arange(0, BK)
        m_ok, n_ok = m < out_features, n < in_features
        a_rows = a_ptr + m.to(tl.int64)[:, None] * tokens
        b_rows = b_ptr + n.to(tl.int64)[:, None] * tokens
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(start, end, BK):
            k = k0 + ks
            k_ok = k < end
            a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc)
        a_scale = tl.load(a_scale_ptr + e * out_features + m, mask=m_ok, other=0.0)
        b_scale = tl.load(b_scale_ptr + e * in_features + n, mask=n_ok, other=0.0)
        acc = acc * a_scale[:, None] * b_scale[None, :]
        out = out_ptr + (e.to(tl.int64) * out_features + m[:, None]) * in_features + n[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
        total = tl.load(out, mask=ok, other=0.0).to(tl.float32) + acc
        tl.store(out, total.to(out_ptr.dtype.element_ty), mask=ok)

    return fp8_grouped_wgrad_accumulate_kernel


def _check(main_grad: torch.Tensor, dyt_codes: torch.Tensor, xt_codes: torch.Tensor, dyt_scale: torch.Tensor,
           xt_scale: torch.Tensor, ends: torch.Tensor) -> None:
    experts = ends.numel()
    out_features, tokens = dyt_codes.shape
    in_features = xt_codes.shape[0]
    expected = {"main_grad": (experts, out_features, in_features), "xt_codes": (in_features, tokens),
                "dyt_scale": (experts * out_features,), "xt_scale": (experts * in_features,)}
    got = {"main_grad": main_grad, "xt_codes": xt_codes, "dyt_scale": dyt_scale, "xt_scale": xt_scale}
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"grouped_wgrad_accumulate_: {name} {tuple(got[name].shape)} must be {shape} "
                             f"(dyt_codes {tuple(dyt_codes.shape)}, {experts} experts)")
    for name, t in {"main_grad": main_grad, "dyt_codes": dyt_codes, "xt_codes": xt_codes}.items():
        if not t.is_contiguous():
            raise ValueError(f"grouped_wgrad_accumulate_: {name} must be contiguous")


def _accumulate(main_grad: torch.Tensor, dyt_codes: torch.Tensor, xt_codes: torch.Tensor, dyt_scale: torch.Tensor,
                xt_scale: torch.Tensor, ends: torch.Tensor) -> None:
    _check(main_grad, dyt_codes, xt_codes, dyt_scale, xt_scale, ends)
    out_features, tokens = dyt_codes.shape
    in_features = xt_codes.shape[0]
    blocks = WGRAD_BLOCKS
    grid = (-(-out_features // blocks["BM"]) * -(-in_features // blocks["BN"]), ends.numel())
    kernel = torch.library.wrap_triton(_kernel())
    with kernel_device(main_grad):
        kernel[grid](dyt_codes, xt_codes, dyt_scale, xt_scale, ends, main_grad, tokens, out_features, in_features,
                     BM=blocks["BM"], BN=blocks["BN"], BK=blocks["BK"], num_warps=blocks["warps"],
                     num_stages=blocks["stages"])


_OP = triton_op("megatron_core::fp8_grouped_wgrad_accumulate_", _accumulate, mutates_args=("main_grad",))


def grouped_wgrad_accumulate_supported(main_grad: torch.Tensor | None, codes: torch.Tensor) -> bool:
    """Whether :func:`grouped_wgrad_accumulate_` serves these tensors: CUDA, a contiguous fp32 or bf16 ``main_grad``,
    Triton and ``torch.library.triton_op`` present."""
    return (main_grad is not None and codes.is_cuda and main_grad.is_cuda and main_grad.is_contiguous()
            and main_grad.dtype in (torch.float32, torch.bfloat16) and _OP is not None and have_triton())


def grouped_wgrad_accumulate_(main_grad: torch.Tensor, dyt_codes: torch.Tensor, xt_codes: torch.Tensor,
                              dyt_scale: torch.Tensor, xt_scale: torch.Tensor, ends: torch.Tensor) -> None:
    """``main_grad[e] += dy_e.T @ x_e`` (dequantized) for every expert, in place (see the module docstring).

    ``main_grad [E, out, in]``, ``dyt_codes [out, M]`` and ``xt_codes [in, M]`` e4m3 (contiguous), ``dyt_scale
    [E * out]`` and ``xt_scale [E * in]`` fp32 dequantizing scales, ``ends [E]`` int32 group end offsets (the last
    ``M``; each a multiple of 16, as the grouped GEMM's groups are). Callers check
    :func:`grouped_wgrad_accumulate_supported` first.
    """
    _OP(main_grad, dyt_codes, xt_codes, dyt_scale, xt_scale, ends)
