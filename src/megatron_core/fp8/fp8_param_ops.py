"""The weight-gradient GEMM of an FP8-parameter linear layer as a ``torch.library`` custom op, and the float8 GEMM
its layer calls.

``megatron_core::fp8_param_wgrad_``: ``main_grad += (dy_t * dy_scale_inv) @ (x_t * x_scale_inv).T`` for the
transposed float8 output gradient ``dy_t [out, t]`` and input ``x_t [in, t]`` (token dimension zero-padded to 16) with
their dequantization factors (the scales' reciprocals, made by the traced code in the kernels that compute the
scales, not by a kernel of their own per GEMM inside the op), added to the
``main_grad`` it is given, a mutated argument, so a compiled backward writes DDP's buffer without reading parameter
attributes (the gradient of a float8 parameter cannot be an ordinary autograd output). It is opaque to
``torch.compile``, so it takes its operands in the layout ``torch._scaled_mm`` wants (each contiguous along the
reduction dimension) and copies nothing: :mod:`megatron_core.fp8.fp8_param_linear` makes the transposed copies in the
traced backward, where Inductor writes them with its own transposing kernels (the output gradient's in the kernel
of its cast; an eager strided copy of a float8 tensor inside the op took 65-107 us per GEMM on an H200). The forward and input-gradient GEMMs (:func:`fp8_mm_nt`) are traced as they
are: Inductor calls ``torch._scaled_mm`` itself (a custom op for them cost a Python dispatch per GEMM on the host).

Eagerly the layer calls :func:`fp8_wgrad_into` directly; the op runs the same function, so both give the same numbers.
On CUDA it is one cuBLASLt GEMM that adds into ``main_grad`` (:mod:`megatron_core.fp8.cublaslt`) where that serves.
"""

from __future__ import annotations

import torch

from megatron_core.fp8 import cublaslt
from megatron_core.fp8.delayed_linear import _fp8_mm

__all__ = ["dequantized_mm_nt", "fp8_mm_nt", "fp8_wgrad_into"]


ACCUMULATE_IN_GEMM = True  # the weight-gradient GEMM adds into main_grad (False: _scaled_mm + add, to time against)


def fp8_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool, fast_accum: bool = False) -> torch.Tensor:
    """``(a / a_scale) @ (b_t / b_scale).T`` in ``out_dtype`` for contiguous float8 ``a [m, k]`` and ``b_t [n, k]``
    (``fast_accum``: see ``_fp8_mm``); no rows (an expert that got no tokens) give an empty product without a GEMM."""
    if a.shape[0] == 0:
        return a.new_empty((0, b_t.shape[0]), dtype=out_dtype)
    return _fp8_mm(a, a_scale, b_t.t(), b_scale, out_dtype, emulate, fast_accum)


def fp8_wgrad_into(main_grad: torch.Tensor, dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, x_t: torch.Tensor,
                   x_scale_inv: torch.Tensor, emulate: bool) -> None:
    """``main_grad += (dy_t * dy_scale_inv) @ (x_t * x_scale_inv).T`` for contiguous float8 ``dy_t [out, t]`` and
    ``x_t [in, t]`` (the output gradient and the input, transposed) and their dequantization factors (the scales'
    reciprocals, fp32, as ``torch._scaled_mm`` takes them: a traced caller computes them in the kernels that make
    the scales): one cuBLASLt GEMM that adds into ``main_grad`` where it serves (and ``ACCUMULATE_IN_GEMM``), else
    ``torch._scaled_mm`` and an add. No tokens (``t == 0``) add nothing."""
    if dy_t.shape[1] == 0:
        return
    if ACCUMULATE_IN_GEMM and not emulate and main_grad.is_cuda and cublaslt.scaled_mm_accumulate_(
            main_grad, dy_t, dy_scale_inv, x_t, x_scale_inv):
        return
    main_grad.add_(dequantized_mm_nt(dy_t, dy_scale_inv, x_t, x_scale_inv, main_grad.dtype, emulate))


def dequantized_mm_nt(a: torch.Tensor, a_scale_inv: torch.Tensor, b_t: torch.Tensor, b_scale_inv: torch.Tensor,
                      out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``(a * a_scale_inv) @ (b_t * b_scale_inv).T`` in ``out_dtype`` for contiguous float8 ``a [m, k]`` and
    ``b_t [n, k]`` and their dequantization factors: ``torch._scaled_mm``, or its fp32 emulation."""
    if emulate:
        return ((a.float() * a_scale_inv) @ (b_t.float() * b_scale_inv).t()).to(out_dtype)
    return torch._scaled_mm(a, b_t.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=out_dtype)


# Defined with the plain ``torch.library.Library`` API rather than ``torch.library.custom_op`` (as the bf16
# weight-gradient op of ``tensor_parallel.wgrad_accumulation``): the dispatcher then calls the Python function directly,
# without custom_op's Python autograd / view / checking layers (38 us against 4 us per call on the CPU host here; a
# backward makes one call per FP8 weight and micro-batch, 88 for the 1.1B model). ``main_grad.add_`` bumps its
# version counter itself.
_LIBRARY = torch.library.Library("megatron_core", "FRAGMENT")
_LIBRARY.define("fp8_param_wgrad_(Tensor(a!) main_grad, Tensor dy_t, Tensor dy_scale_inv, Tensor x_t, "
                "Tensor x_scale_inv, bool emulate) -> ()")
_LIBRARY.impl("fp8_param_wgrad_", fp8_wgrad_into, "CompositeExplicitAutograd")


@torch.library.register_fake("megatron_core::fp8_param_wgrad_", lib=_LIBRARY)
def _(main_grad: torch.Tensor, dy_t: torch.Tensor, dy_scale_inv: torch.Tensor, x_t: torch.Tensor,
      x_scale_inv: torch.Tensor, emulate: bool) -> None:
    return None
