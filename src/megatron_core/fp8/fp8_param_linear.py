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
mark), as Megatron-Core's fused weight-gradient accumulation. With ``fp8_wgrad=False`` (``config.fp8_wgrad``, the
layer's ``float8_wgrad``) the forward keeps the unquantized input and the weight gradient is the high-precision GEMM
``dy.T @ x`` of the bf16 layers' gradient-accumulation fusion
(:func:`megatron_core.tensor_parallel.wgrad_accumulation.accumulate_weight_gradient`: bf16 operands, added into an
fp32 ``main_grad`` by cuBLAS where the build allows; fp32 when emulated); the other two GEMMs stay FP8.

``torch.compile`` traces the op without a graph break (``fullgraph=True``): the parameter attributes it needs
(scale, ``main_grad``, the kind of placeholder gradient) are read before the autograd function and passed in, the
amax / scale / cast of the input and of the output gradient, and the transposed copies the GEMMs need (the input
and the output gradient for the weight gradient, the weight for the input gradient), are plain torch ops that
Inductor fuses with their neighbours (the amax max-reduced by a functional all-reduce); the forward and
input-gradient GEMMs are traced too, and the weight-gradient GEMM, which writes the ``main_grad`` it is given, is
the custom op of :mod:`megatron_core.fp8.fp8_param_ops`.

GEMMs are ``torch._scaled_mm`` on CUDA (the forward one with fast accumulation, as Transformer Engine's and
torchao's recipes; the gradients' with full-precision accumulation; the weight gradient's a cuBLASLt GEMM that adds
into ``main_grad``, :mod:`megatron_core.fp8.cublaslt`), and fp32 emulation (the same quantized operands dequantized)
elsewhere or with ``emulate``; see :mod:`megatron_core.fp8.delayed_linear`.

The weight's transposed codes (the data-gradient GEMM's operand) are cached for a step when the schedule says where
steps begin (``set_is_first_microbatch``, as Transformer Engine's FP8 weights): see :func:`_cached_weight_transpose`.

With ``activation="swiglu"`` (an MLP's ``linear_fc1``, see ``Float8ColumnParallelLinear.forward_swiglu``) the
function returns ``silu(gate) * up`` of the GEMM's output ``[gate; up]`` with its amax, made in one pass
(:mod:`megatron_core.fp8.swiglu_amax`; ``linear_fc2`` takes it as ``x_amax`` instead of reading its input again),
and keeps the GEMM's output for its backward, which quantizes SwiGLU's gradient without storing it in bf16
(:mod:`megatron_core.fp8.swiglu_grad_cast`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import _functional_collectives as funcol

from megatron_core._ground import get_pg_size
from megatron_core.distributed.fp8_params import FP8_PARAM_DTYPE, amax_or_zero, quantize, tensorwise_scale
from megatron_core.fp8.cast_kernels import cast_transpose, cast_transpose_serves, transpose_codes
from megatron_core.fp8.delayed_linear import _pad_rows
from megatron_core.fp8.fp8_param_ops import fp8_mm_nt, fp8_wgrad_into
from megatron_core.fp8.swiglu_amax import swiglu_with_amax
from megatron_core.fp8.swiglu_grad_cast import (
    swiglu_grad,
    swiglu_grad_amax,
    swiglu_grad_cast_serves,
    swiglu_grad_cast_transpose,
)
from megatron_core.tensor_parallel.wgrad_accumulation import (
    accumulate_weight_gradient,
    finish_fused_weight_gradient,
)

__all__ = ["SWIGLU", "Float8ParamMatmul", "allocate_weight_transpose", "fp8_param_matmul"]

SWIGLU = "swiglu"  # the activation Float8ParamMatmul can apply to its output

# What the backward returns as the weight's autograd gradient (see ``finish_fused_weight_gradient``).
NO_PLACEHOLDER, EMPTY_PLACEHOLDER, ZERO_PLACEHOLDER = "none", "empty", "zeros"


def _placeholder_kind(weight: torch.Tensor) -> str:
    """The placeholder gradient ``finish_fused_weight_gradient`` gives ``weight``: none without DDP, zeros for a
    ``zero_out_wgrad`` weight, else uninitialized."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return NO_PLACEHOLDER
    return ZERO_PLACEHOLDER if getattr(weight, "zero_out_wgrad", False) else EMPTY_PLACEHOLDER


def _scale_of_amax(amax: torch.Tensor, dtype: torch.dtype, group: Any) -> torch.Tensor:
    """The tensorwise scale for float8 ``dtype`` of a tensor whose amax is ``amax`` (max-reduced over ``group``,
    a functional collective that a compiled graph keeps)."""
    if group is not None:
        amax = funcol.all_reduce(amax, "max", group)
    return tensorwise_scale(amax, dtype)


def _current_scale(t: torch.Tensor, dtype: torch.dtype, group: Any) -> torch.Tensor:
    """The tensorwise scale of ``t`` for float8 ``dtype`` (see :func:`_scale_of_amax`); an empty ``t`` (an expert
    that got no tokens) has amax 0 and still joins ``group``'s reduction, which the other ranks wait for."""
    return _scale_of_amax(amax_or_zero(t), dtype, group)


FUSED_CASTS = True  # the CUDA casts through cast_transpose (False: plain torch ops, the reference it is timed against)
# An MLP's SwiGLU inside its FP8 fc1's autograd function, whose backward quantizes SwiGLU's gradient with
# swiglu_grad_cast's kernels (False: the MLP applies SwiGLU itself, the reference it is timed against).
FUSED_SWIGLU_GRAD = True


def _fused_cast(t: torch.Tensor, emulate: bool) -> bool:
    """Whether ``t``'s cast writes its row-major and transposed codes in one kernel (:func:`cast_transpose`)."""
    return FUSED_CASTS and not emulate and cast_transpose_serves(t)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """Float8 ``t [m, k]`` (rows zero-padded to a multiple of 16) as a contiguous ``[k, m]``: an operand of the
    weight-gradient GEMM, whose reduction runs over the tokens."""
    return _pad_rows(t).t().contiguous()


class Float8ParamMatmul(torch.autograd.Function):
    """``x @ weight.T`` for an FP8 parameter ``weight``; its gradient goes to ``main_grad``.

    ``w_scale``, ``main_grad`` and ``placeholder`` (one of ``'none'``, ``'empty'``, ``'zeros'``) default to
    ``weight``'s ``fp8_scale``, ``main_grad`` and DDP marks; :func:`fp8_param_matmul` passes them, so that a
    compiled graph reads no parameter attribute inside the function. ``weight_t``: the weight's transposed codes
    for the data gradient, cached for the step (``None``: the backward transposes the weight). ``activation``:
    ``None``, or :data:`SWIGLU` for ``swiglu(x @ weight.T)`` (the GEMM's output kept for the backward); then the
    function returns ``(output, amax)``, the output's amax (0-d fp32, not differentiable) made in the same pass
    (:mod:`megatron_core.fp8.swiglu_amax`) for the next FP8 GEMM's ``x_amax``. ``x_amax``: ``x``'s amax when the
    caller has it (the input's scale then needs no pass over ``x``). ``fp8_wgrad``: False computes the weight
    gradient from the unquantized ``x`` and output gradient (a Python constant, fixed when a graph is traced).
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, grad_dtype: torch.dtype, amax_group: Any,
                emulate: bool, w_scale: torch.Tensor | None = None, main_grad: torch.Tensor | None = None,
                placeholder: str | None = None, weight_t: torch.Tensor | None = None,
                activation: str | None = None, x_amax: torch.Tensor | None = None, fp8_wgrad: bool = True) -> Any:
        """The float8 product with the stored weight bytes and scale; the input cast with its current scale."""
        if activation not in (None, SWIGLU):
            raise ValueError(f"Float8ParamMatmul: activation {activation!r} is not None or {SWIGLU!r}")
        if w_scale is None:
            w_scale = weight.fp8_scale
        if main_grad is None:
            main_grad = getattr(weight, "main_grad", None)
        x2 = x.reshape(-1, x.shape[-1])
        x_scale = (_current_scale(x2, FP8_PARAM_DTYPE, amax_group) if x_amax is None
                   else _scale_of_amax(x_amax, FP8_PARAM_DTYPE, amax_group))
        x_scale_inv = x_scale.reciprocal()  # the weight gradient's factor, made where the forward GEMM's is
        ctx.fp8_wgrad = fp8_wgrad
        ctx.x_transposed = fp8_wgrad and _fused_cast(x2, emulate)
        if ctx.x_transposed:  # the weight gradient's transposed input is written with the forward's codes
            x_q, x_saved = cast_transpose(x2, x_scale, FP8_PARAM_DTYPE)
        else:
            x_q = quantize(x2, x_scale, FP8_PARAM_DTYPE)
            x_saved = x_q if fp8_wgrad else x2  # the high-precision weight gradient's input: x as it came
        w_scale = w_scale.detach().clone()
        out = fp8_mm_nt(x_q, x_scale, weight, w_scale, x.dtype, emulate, fast_accum=True)  # as TE's and torchao's
        # main_grad is not a saved tensor: it shares the version counter of DDP's whole buffer, which other
        # layers' backward passes write before this one runs.
        ctx.main_grad = main_grad
        ctx.placeholder = _placeholder_kind(weight) if placeholder is None else placeholder
        ctx.grad_dtype, ctx.amax_group, ctx.emulate = grad_dtype, amax_group, emulate
        ctx.x_shape, ctx.x_dtype = x.shape, x.dtype
        pre_activation = out if activation == SWIGLU else None
        ctx.save_for_backward(x_saved, x_scale_inv, weight, w_scale, weight_t, pre_activation)
        if activation == SWIGLU:
            out, out_amax = swiglu_with_amax(out)
            ctx.mark_non_differentiable(out_amax)
            return out.reshape(*x.shape[:-1], out.shape[-1]), out_amax
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any):
        """Data gradient, and the weight gradient accumulated into ``main_grad`` (placeholder autograd gradient)."""
        x_saved, x_scale_inv, weight, w_scale, weight_t, pre_activation = ctx.saved_tensors
        dy_q, dy_t, g_scale, dy = _quantized_output_grad(ctx, grad.reshape(-1, grad.shape[-1]), pre_activation)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            w_t = _weight_transpose(weight, ctx.emulate) if weight_t is None else weight_t
            grad_x = fp8_mm_nt(dy_q, g_scale, w_t, w_scale, ctx.x_dtype, ctx.emulate)
            grad_x = grad_x.reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            main_grad = ctx.main_grad
            if main_grad is None:
                raise RuntimeError("an FP8 parameter (fp8_param=True) accumulates its gradient into main_grad: wrap "
                                   "the model in DistributedDataParallel with use_distributed_optimizer=True")
            if ctx.fp8_wgrad:
                _fp8_wgrad_into(ctx, main_grad, dy_q, dy_t, g_scale, x_saved, x_scale_inv)
            else:
                _high_precision_wgrad_into(main_grad, dy, x_saved, ctx.emulate)
            grad_w = (_placeholder(weight, ctx.placeholder) if torch.compiler.is_compiling()
                      else finish_fused_weight_gradient(weight))
        return grad_x, grad_w, None, None, None, None, None, None, None, None, None, None


def _fp8_wgrad_into(ctx: Any, main_grad: torch.Tensor, dy_q: torch.Tensor, dy_t: torch.Tensor | None,
                    g_scale: torch.Tensor, x_saved: torch.Tensor, x_scale_inv: torch.Tensor) -> None:
    """``main_grad += dy.T @ x`` from the float8 codes of the output gradient and the input (transposed here unless
    a cast kernel already wrote them transposed): the custom op inside a compiled graph, else its function."""
    dy_t = _transposed(dy_q) if dy_t is None else dy_t
    x_t = x_saved if ctx.x_transposed else _transposed(x_saved)
    g_scale_inv = g_scale.reciprocal()  # as the data gradient's GEMM takes it: one computation
    if torch.compiler.is_compiling():
        torch.ops.megatron_core.fp8_param_wgrad_(main_grad, dy_t, g_scale_inv, x_t, x_scale_inv, ctx.emulate)
    else:
        fp8_wgrad_into(main_grad, dy_t, g_scale_inv, x_t, x_scale_inv, ctx.emulate)


def _high_precision_wgrad_into(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, emulate: bool) -> None:
    """``main_grad += dy.T @ x`` from the unquantized output gradient and input (``fp8_wgrad=False``): the bf16
    layers' fused weight-gradient GEMM (its custom op inside a compiled graph), in fp32 when emulated."""
    dy, x = (dy.float(), x.float()) if emulate else (dy.to(x.dtype), x)
    if torch.compiler.is_compiling():
        torch.ops.megatron_core.accumulate_weight_gradient(main_grad, dy, x)
    else:
        accumulate_weight_gradient(main_grad, dy, x)


def _quantized_output_grad(ctx: Any, grad: torch.Tensor, pre_activation: torch.Tensor | None
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]:
    """The GEMM output's gradient ``dy`` as float8 codes, their transposed copy where one kernel wrote both (else
    ``None``), their scale, and ``dy`` unquantized (``None`` where the fused SwiGLU kernels never made it, which
    they do only for an FP8 weight gradient): ``dy`` is ``grad``, or SwiGLU's gradient at ``pre_activation`` times
    ``grad``."""
    transposed = ctx.needs_input_grad[1] and ctx.fp8_wgrad
    if pre_activation is not None:
        grad = grad.contiguous()
        if ctx.fp8_wgrad and _fused_cast(grad, ctx.emulate) and swiglu_grad_cast_serves(grad, pre_activation):
            g_scale = _scale_of_amax(swiglu_grad_amax(grad, pre_activation), ctx.grad_dtype, ctx.amax_group)
            dy_q, dy_t = swiglu_grad_cast_transpose(grad, pre_activation, g_scale, ctx.grad_dtype)
            return dy_q, dy_t if transposed else None, g_scale, None
        grad = swiglu_grad(grad, pre_activation)
    g_scale = _current_scale(grad, ctx.grad_dtype, ctx.amax_group)
    if _fused_cast(grad, ctx.emulate) and transposed:
        dy_q, dy_t = cast_transpose(grad, g_scale, ctx.grad_dtype)
        return dy_q, dy_t, g_scale, grad
    return quantize(grad, g_scale, ctx.grad_dtype), None, g_scale, grad


def _weight_transpose(weight: torch.Tensor, emulate: bool) -> torch.Tensor:
    """The FP8 weight's codes transposed, contiguous ``[in, out]``: the data-gradient GEMM's operand."""
    return transpose_codes(weight.unsqueeze(0))[0] if _fused_cast(weight, emulate) else weight.t().contiguous()


def allocate_weight_transpose(weight: torch.Tensor) -> None:
    """Give the FP8 parameter ``weight`` its transposed-codes cache ``weight.fp8_transpose`` (kept while its shape
    and device hold), at a static address for compiled CUDA graphs, which refresh it in place."""
    cache = getattr(weight, "fp8_transpose", None)
    if cache is None or cache.shape != weight.shape[::-1] or cache.device != weight.device:
        weight.fp8_transpose = torch.empty(weight.shape[::-1], dtype=weight.dtype, device=weight.device)
        torch._dynamo.mark_static_address(weight.fp8_transpose, guard=False)


def _cached_weight_transpose(weight: torch.Tensor, layer: torch.nn.Module, emulate: bool) -> torch.Tensor | None:
    """``weight``'s transposed codes for the backward, cached across the micro-batches of a step as Transformer
    Engine caches its FP8 weights: refreshed when ``layer.is_first_microbatch`` is True (then set False), reused
    while it is False; ``None`` (the backward transposes) when the layer is not told where steps begin (the flag is
    None) or has no cache (:func:`allocate_weight_transpose`)."""
    first = getattr(layer, "is_first_microbatch", None)
    cache = getattr(weight, "fp8_transpose", None)
    if first is None or cache is None:
        return None
    if first:
        with torch.no_grad():
            cache.copy_(_weight_transpose(weight, emulate))
        layer.is_first_microbatch = False
    return cache


def _placeholder(weight: torch.Tensor, kind: str) -> torch.Tensor | None:
    """The placeholder gradient ``kind`` (see :func:`_placeholder_kind`) of ``weight``."""
    if kind == NO_PLACEHOLDER:
        return None
    return torch.zeros_like(weight) if kind == ZERO_PLACEHOLDER else torch.empty_like(weight)


def fp8_param_matmul(x: torch.Tensor, weight: torch.Tensor, layer: torch.nn.Module, activation: str | None = None,
                     x_amax: torch.Tensor | None = None) -> Any:
    """``x @ weight.T`` for the FP8 parameter ``weight`` of ``layer`` (its ``fp8_param_grad_dtype`` and
    ``fp8_param_amax_group``; emulated off CUDA or with ``layer.float8_emulate``), through ``activation`` if given
    (then ``(output, amax)``), with ``x``'s amax if the caller has it, and the weight gradient in high precision when
    ``layer.float8_wgrad`` is False (see :class:`Float8ParamMatmul`). Traceable by ``torch.compile``."""
    emulate = bool(getattr(layer, "float8_emulate", False)) or x.device.type != "cuda"
    group = layer.fp8_param_amax_group
    if get_pg_size(group) <= 1:
        group = None
    return Float8ParamMatmul.apply(x, weight, layer.fp8_param_grad_dtype, group, emulate, weight.fp8_scale,
                                   getattr(weight, "main_grad", None), _placeholder_kind(weight),
                                   _cached_weight_transpose(weight, layer, emulate), activation, x_amax,
                                   bool(getattr(layer, "float8_wgrad", True)))
