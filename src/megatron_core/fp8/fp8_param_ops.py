"""The float8 GEMMs of an FP8-parameter linear layer as ``torch.library`` custom ops (opaque to ``torch.compile``).

:mod:`megatron_core.fp8.fp8_param_linear` calls them inside compiled graphs, where the casts around them stay
plain torch ops that Inductor fuses with their neighbours:

* ``megatron_core::fp8_param_mm``: ``(a / a_scale) @ (b / b_scale)`` for float8 ``a [m, k]`` and ``b [k, n]``
  (``torch._scaled_mm`` on CUDA, fp32 emulation with ``emulate``), the forward and the input-gradient GEMM;
* ``megatron_core::fp8_param_wgrad_``: ``main_grad += (dy / dy_scale).T @ (x / x_scale)``, the weight-gradient
  GEMM (token dimension zero-padded to 16 for ``torch._scaled_mm``) added to the ``main_grad`` it is given, a
  mutated argument, so a compiled backward writes DDP's buffer without reading parameter attributes.

Eagerly the layer calls ``_fp8_mm`` (:mod:`megatron_core.fp8.delayed_linear`) and :func:`fp8_wgrad_into`
directly (no dispatcher overhead); the ops run the same functions, so both give the same numbers.
"""

from __future__ import annotations

import torch

from megatron_core.fp8.delayed_linear import _fp8_mm, _pad_rows

__all__ = ["fp8_wgrad_into"]


def fp8_wgrad_into(main_grad: torch.Tensor, dy_q: torch.Tensor, dy_scale: torch.Tensor, x_q: torch.Tensor,
                   x_scale: torch.Tensor, emulate: bool) -> None:
    """``main_grad += (dy_q / dy_scale).T @ (x_q / x_scale)`` for float8 ``dy_q [t, out]`` and ``x_q [t, in]``."""
    main_grad.add_(_fp8_mm(_pad_rows(dy_q).t(), dy_scale, _pad_rows(x_q), x_scale, main_grad.dtype, emulate))


@torch.library.custom_op("megatron_core::fp8_param_mm", mutates_args=())
def _fp8_param_mm_op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    return _fp8_mm(a, a_scale, b, b_scale, out_dtype, emulate)


@_fp8_param_mm_op.register_fake
def _(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype,
      emulate: bool) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


@torch.library.custom_op("megatron_core::fp8_param_wgrad_", mutates_args=("main_grad",))
def _fp8_param_wgrad_op(main_grad: torch.Tensor, dy_q: torch.Tensor, dy_scale: torch.Tensor, x_q: torch.Tensor,
                        x_scale: torch.Tensor, emulate: bool) -> None:
    fp8_wgrad_into(main_grad, dy_q, dy_scale, x_q, x_scale, emulate)


@_fp8_param_wgrad_op.register_fake
def _(main_grad: torch.Tensor, dy_q: torch.Tensor, dy_scale: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor,
      emulate: bool) -> None:
    return None
