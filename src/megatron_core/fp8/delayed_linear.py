"""The float8 GEMM of a linear layer with delayed per-tensor scales (``fp8_recipe='delayed'``).

Transformer Engine's ``Linear`` under its ``DelayedScaling`` recipe, written with PyTorch ops:
:class:`DelayedFloat8Matmul` computes ``x @ W.T`` with ``x`` and ``W`` quantized to e4m3 using the
layer's current scales (:mod:`megatron_core.fp8.delayed_scaling`), and in the backward pass the
output gradient quantized (e4m3, or e5m2 with ``fp8='hybrid'``) for both gradient GEMMs:
``dx = dy @ W`` and ``dW = dy.T @ x`` (in high precision with ``fp8_wgrad=False``). The amaxes of the
three operands are max-reduced over the layer's amax reduction group (``fp8_amax_group``: tensor x
data x context parallel, as Megatron-Core's default) before they are recorded, so every rank holds the
same scales, equal to those of one process on the whole tensors and the whole global batch.

On a CUDA device the GEMMs are ``torch._scaled_mm`` (first operand row-major, second column-major,
inverse scales passed to the kernel; the wgrad's inner dimension, the tokens, is zero-padded to a
multiple of 16). Elsewhere, or with ``emulate``, the same quantized operands are dequantized and
multiplied in fp32: the CPU reference the GPU path is tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.distributed.fp8_params import quantize, reduce_amax
from megatron_core.fp8.delayed_scaling import (
    BACKWARD_COLUMNS,
    FORWARD_COLUMNS,
    GRAD_OUTPUT,
    INPUT,
    WEIGHT,
    record_amax,
)

MM_ALIGN = 16


def _amax(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.stack([t.detach().abs().amax().float() for t in tensors])


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """Float8 ``t [m, k]`` with zero rows appended up to a multiple of 16 (through a uint8 view)."""
    extra = -t.shape[0] % MM_ALIGN
    if not extra:
        return t
    bits = t.view(torch.uint8)
    return torch.cat([bits, bits.new_zeros(extra, t.shape[1])]).view(t.dtype)


def _fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
            out_dtype: torch.dtype, emulate: bool, fast_accum: bool = False) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale)`` for float8 ``a [m, k]`` and ``b [k, n]``, in ``out_dtype``; ``fast_accum``:
    Hopper's faster FP8 accumulation (what Transformer Engine and torchao use for the forward GEMM; no effect when
    emulated)."""
    if emulate:
        return ((a.float() / a_scale) @ (b.float() / b_scale)).to(out_dtype)
    return torch._scaled_mm(a.contiguous(), b.t().contiguous().t(), scale_a=a_scale.reciprocal(),
                            scale_b=b_scale.reciprocal(), out_dtype=out_dtype, use_fast_accum=fast_accum)


class DelayedFloat8Matmul(torch.autograd.Function):
    """``x @ weight.T`` with float8 operands scaled by ``layer``'s delayed-scaling state.

    ``layer`` carries ``float8_recipe``, ``fp8_amax_history``, ``fp8_scale`` and ``fp8_amax_group``; ``record``
    says whether this call records amaxes and moves the scales on (training mode): the forward's
    operands unless ``scale`` is given (the scales of a recomputed forward's first pass), and the output
    gradient in any case.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, layer: torch.nn.Module, record: bool,
                emulate: bool, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The float8 product; records the operands' amaxes unless this is a recompute (``scale`` given)."""
        recipe = layer.float8_recipe
        x2 = x.reshape(-1, x.shape[-1])
        recompute = scale is not None
        scale = (layer.fp8_scale if scale is None else scale).detach().clone()
        x_q = quantize(x2, scale[INPUT], recipe.forward_dtype)
        w_q = quantize(weight, scale[WEIGHT], recipe.forward_dtype)
        out = _fp8_mm(x_q, scale[INPUT], w_q.t(), scale[WEIGHT], x.dtype, emulate)
        if record and not recompute:
            record_amax(layer, FORWARD_COLUMNS, reduce_amax(_amax(x2, weight), layer.fp8_amax_group))
        ctx.layer, ctx.record, ctx.emulate = layer, record, emulate
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, weight.dtype
        ctx.save_for_backward(x_q, w_q, scale, None if recipe.fp8_wgrad else x2)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        """Data and weight gradients from the float8 output gradient (weight gradient in high precision without
        ``fp8_wgrad``)."""
        x_q, w_q, fwd_scale, x_hp = ctx.saved_tensors
        layer, emulate = ctx.layer, ctx.emulate
        recipe = layer.float8_recipe
        dy = grad.reshape(-1, grad.shape[-1])
        g_scale = layer.fp8_scale[GRAD_OUTPUT].detach().clone()
        dy_q = quantize(dy, g_scale, recipe.backward_dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _fp8_mm(dy_q, g_scale, w_q, fwd_scale[WEIGHT], ctx.x_dtype, emulate).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            if x_hp is not None:
                grad_w = (dy.t().to(x_hp.dtype) @ x_hp).to(ctx.w_dtype)
            else:
                grad_w = _fp8_mm(_pad_rows(dy_q).t(), g_scale, _pad_rows(x_q), fwd_scale[INPUT], ctx.w_dtype,
                                 emulate)
        if ctx.record:
            record_amax(layer, BACKWARD_COLUMNS, reduce_amax(_amax(dy), layer.fp8_amax_group))
        return grad_x, grad_w, None, None, None, None


def delayed_float8_matmul(x: torch.Tensor, weight: torch.Tensor, layer: torch.nn.Module,
                          emulate: bool = False) -> torch.Tensor:
    """``x @ weight.T`` in float8 with ``layer``'s delayed scales; records amaxes when ``layer.training``.

    Activation recompute (Megatron-Core's reentrant ``tensor_parallel.checkpoint``): a training forward
    without grad, the first pass of a checkpointed region, stashes the scales it used; the recomputation,
    a forward run inside the backward pass, takes them back in order and records nothing, so it
    rebuilds exactly the activations of the first pass and each step records its amaxes once.
    """
    emulate = emulate or x.device.type != "cuda"
    stash = layer.fp8_recompute_stash
    if torch._C._current_graph_task_id() != -1 and stash:  # run by the autograd engine: a recomputation
        return DelayedFloat8Matmul.apply(x, weight, layer, layer.training, emulate, stash.popleft())
    if layer.training and not torch.is_grad_enabled():
        stash.append(layer.fp8_scale.detach().clone())
    return DelayedFloat8Matmul.apply(x, weight, layer, layer.training, emulate, None)
