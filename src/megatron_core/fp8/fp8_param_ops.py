"""The float8 GEMMs of an FP8-parameter linear layer as ``torch.library`` custom ops (opaque to ``torch.compile``).

Both take their operands in the layout ``torch._scaled_mm`` wants (each row-major along the reduction dimension,
``[m, k]`` and ``[n, k]``), so the ops copy nothing: :mod:`megatron_core.fp8.fp8_param_linear` makes the
transposed copies in the traced code, where Inductor writes them in the same kernels as the casts (an eager
strided copy of a float8 tensor inside the op took 65-107 us per GEMM on an H200, 84 ms of a 1.1B model's
``fwd+bwd`` of 4 micro-batches):

* ``megatron_core::fp8_param_mm``: ``(a / a_scale) @ (b_t / b_scale).T`` for float8 ``a [m, k]`` and
  ``b_t [n, k]`` (``torch._scaled_mm`` on CUDA, fp32 emulation with ``emulate``), the forward and the
  input-gradient GEMM;
* ``megatron_core::fp8_param_wgrad_``: ``main_grad += (dy_t / dy_scale) @ (x_t / x_scale).T`` for the transposed
  float8 output gradient ``dy_t [out, t]`` and input ``x_t [in, t]`` (token dimension zero-padded to 16), the
  weight-gradient GEMM added to the ``main_grad`` it is given, a mutated argument, so a compiled backward writes
  DDP's buffer without reading parameter attributes.

Eagerly the layer calls :func:`fp8_mm_nt` and :func:`fp8_wgrad_into` directly (no dispatcher overhead); the ops
run the same functions, so both give the same numbers.
"""

from __future__ import annotations

import torch

from megatron_core.fp8.delayed_linear import _fp8_mm

__all__ = ["fp8_mm_nt", "fp8_wgrad_into"]


def fp8_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``(a / a_scale) @ (b_t / b_scale).T`` in ``out_dtype`` for contiguous float8 ``a [m, k]`` and ``b_t [n, k]``."""
    return _fp8_mm(a, a_scale, b_t.t(), b_scale, out_dtype, emulate)


def fp8_wgrad_into(main_grad: torch.Tensor, dy_t: torch.Tensor, dy_scale: torch.Tensor, x_t: torch.Tensor,
                   x_scale: torch.Tensor, emulate: bool) -> None:
    """``main_grad += (dy_t / dy_scale) @ (x_t / x_scale).T`` for contiguous float8 ``dy_t [out, t]`` and
    ``x_t [in, t]`` (the output gradient and the input, transposed)."""
    main_grad.add_(fp8_mm_nt(dy_t, dy_scale, x_t, x_scale, main_grad.dtype, emulate))


@torch.library.custom_op("megatron_core::fp8_param_mm", mutates_args=())
def _fp8_param_mm_op(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    return fp8_mm_nt(a, a_scale, b_t, b_scale, out_dtype, emulate)


@_fp8_param_mm_op.register_fake
def _(a: torch.Tensor, a_scale: torch.Tensor, b_t: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
      emulate: bool) -> torch.Tensor:
    return a.new_empty((a.shape[0], b_t.shape[0]), dtype=out_dtype)


@torch.library.custom_op("megatron_core::fp8_param_wgrad_", mutates_args=("main_grad",))
def _fp8_param_wgrad_op(main_grad: torch.Tensor, dy_t: torch.Tensor, dy_scale: torch.Tensor, x_t: torch.Tensor,
                        x_scale: torch.Tensor, emulate: bool) -> None:
    fp8_wgrad_into(main_grad, dy_t, dy_scale, x_t, x_scale, emulate)


@_fp8_param_wgrad_op.register_fake
def _(main_grad: torch.Tensor, dy_t: torch.Tensor, dy_scale: torch.Tensor, x_t: torch.Tensor, x_scale: torch.Tensor,
      emulate: bool) -> None:
    return None
