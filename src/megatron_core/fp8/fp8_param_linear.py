"""The float8 GEMM of a linear layer whose weight is an FP8 parameter (``fp8_param``, tensorwise recipe).

What Transformer Engine's ``Linear`` does with a ``Float8Tensor`` weight under current scaling: the
stored e4m3 bytes and their scale (:mod:`megatron_core.distributed.fp8_params`) enter the GEMM as they are (no
cast of the weight); the input and, in the backward pass, the output gradient are quantized with
per-tensor scales from their current amax (torchao's tensorwise formula; e4m3, or e5m2 for the output
gradient with ``fp8='hybrid'``), max-reduced over ``layer.fp8_param_amax_group`` when one is set
(``None``: each rank's own tensors, as torchao). Both gradient GEMMs run in float8: ``dx = dy @ W`` and
``dW = dy.T @ x``; ``dW`` is accumulated into ``weight.main_grad`` (the DDP gradient buffer, in the
parameter's high-precision or fp32 dtype) and the weight's autograd gradient is a placeholder that DDP's
hook ignores (``grad_added_to_main_grad``, and the parameter's static ``backward_adds_to_main_grad``
mark), as Megatron-Core's fused weight-gradient accumulation. The op runs eagerly inside a layer
compiled by ``torch.compile`` (its backward reads and writes parameter attributes).

GEMMs are ``torch._scaled_mm`` on CUDA, and fp32 emulation (the same quantized operands dequantized)
elsewhere or with ``emulate``; see :mod:`megatron_core.fp8.delayed_linear`.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.distributed.fp8_params import FP8_PARAM_DTYPE, quantize, reduce_amax, tensorwise_scale
from megatron_core.fp8.delayed_linear import _fp8_mm, _pad_rows
from megatron_core.tensor_parallel.wgrad_accumulation import finish_fused_weight_gradient

__all__ = ["Float8ParamMatmul", "fp8_param_matmul"]


def _current_scale(t: torch.Tensor, dtype: torch.dtype, group: Any) -> torch.Tensor:
    """The tensorwise scale of ``t`` for float8 ``dtype`` (amax max-reduced over ``group``)."""
    return tensorwise_scale(reduce_amax(t.detach().abs().amax().float(), group), dtype)


class Float8ParamMatmul(torch.autograd.Function):
    """``x @ weight.T`` for an FP8 parameter ``weight``; its gradient goes to ``weight.main_grad``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype, amax_group: Any,
                emulate: bool) -> torch.Tensor:
        """The float8 product with the stored weight bytes and scale; the input cast with its current scale."""
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = _current_scale(x2, FP8_PARAM_DTYPE, amax_group)
        x_q = quantize(x2, x_scale, FP8_PARAM_DTYPE)
        w_scale = weight.fp8_scale.detach().clone()
        out = _fp8_mm(x_q, x_scale, weight.t(), w_scale, x.dtype, emulate)
        ctx.weight, ctx.grad_dtype, ctx.amax_group, ctx.emulate = weight, grad_dtype, amax_group, emulate
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        ctx.save_for_backward(x_q, x_scale, w_scale)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """Data gradient, and the weight gradient accumulated into ``main_grad`` (dummy autograd gradient)."""
        x_q, x_scale, w_scale = ctx.saved_tensors
        weight = ctx.weight
        dy = grad.reshape(-1, grad.shape[-1])
        g_scale = _current_scale(dy, ctx.grad_dtype, ctx.amax_group)
        dy_q = quantize(dy, g_scale, ctx.grad_dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_mm(dy_q, g_scale, weight, w_scale, ctx.x_dtype, ctx.emulate).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            main_grad = getattr(weight, "main_grad", None)
            if main_grad is None:
                raise RuntimeError("an FP8 parameter (fp8_param=True) accumulates its gradient into main_grad: wrap "
                                   "the model in DistributedDataParallel with use_distributed_optimizer=True")
            main_grad.add_(_fp8_mm(_pad_rows(dy_q).t(), g_scale, _pad_rows(x_q), x_scale, main_grad.dtype,
                                   ctx.emulate))
            grad_w = finish_fused_weight_gradient(weight)
        return grad_x, grad_w, None, None, None


@torch.compiler.disable
def fp8_param_matmul(x: torch.Tensor, weight: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    """``x @ weight.T`` for the FP8 parameter ``weight`` of ``layer`` (its ``fp8_param_grad_dtype`` and
    ``fp8_param_amax_group``; emulated off CUDA or with ``layer.float8_emulate``)."""
    emulate = bool(getattr(layer, "float8_emulate", False)) or x.device.type != "cuda"
    return Float8ParamMatmul.apply(x, weight, layer.fp8_param_grad_dtype, layer.fp8_param_amax_group, emulate)
