"""The matmul autograd op behind the parallel linear layers, with its tensor-parallel communication.

``linear_with_grad_accumulation_and_async_allreduce`` is Megatron-Core's core op. Forward: with
sequence parallelism, all-gather the input along the sequence dim first; then ``x @ W^T + b``.
Backward: the input gradient is all-reduced over TP (``allreduce_dgrad``) or reduce-scattered
along the sequence (sequence parallel); the weight gradient goes to ``weight.main_grad`` (fp32)
when ``gradient_accumulation_fusion`` is on and the parameter has one, as Megatron's fused wgrad
kernel does, else to ``weight.grad`` as usual. With sequence parallelism the gathered input is
not kept: backward gathers it again, trading a second all-gather for activation memory.
With a tensor-parallel group of one and nothing to fuse or defer, the op is plain ``F.linear``; a
single row without grad on CUDA (a decode step at batch 1) runs :func:`~megatron_core.tensor_parallel.fused_gemv.fused_gemv`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core._ground import get_pg_size
from megatron_core.tensor_parallel.fused_gemv import fused_gemv, fused_gemv_supported
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import (
    _all_reduce,
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
)
from megatron_core.tensor_parallel.wgrad_accumulation import (
    accumulate_weight_gradient,
    finish_fused_weight_gradient,
)


def _flatten_tokens(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.size(-1))


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``x @ W^T + b`` with TP communication of the input (forward) and of its gradient (backward)."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                sequence_parallel, grad_output_buffer, wgrad_deferral_limit, tp_group):
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.grad_output_buffer = grad_output_buffer
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.tp_group = tp_group
        ctx.weight_requires_grad = weight.requires_grad
        total_input = _gather_along_first_dim(input, tp_group) if sequence_parallel else input
        ctx.save_for_backward(input, weight)
        output = torch.matmul(total_input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        tp_group = ctx.tp_group
        grad_input = grad_output.matmul(weight)
        if ctx.sequence_parallel:
            grad_input = _reduce_scatter_along_first_dim(grad_input, tp_group)
        elif ctx.allreduce_dgrad:
            grad_input = _all_reduce(grad_input, tp_group)

        grad_weight = None
        if ctx.weight_requires_grad:
            deferred = ctx.grad_output_buffer is not None and (
                ctx.wgrad_deferral_limit == 0 or len(ctx.grad_output_buffer) < ctx.wgrad_deferral_limit
            )
            if deferred:
                ctx.grad_output_buffer.append(grad_output)
            else:
                total_input = _gather_along_first_dim(input, tp_group) if ctx.sequence_parallel else input
                grad_weight = _weight_gradient(ctx, weight, _flatten_tokens(grad_output),
                                               _flatten_tokens(total_input))
        grad_bias = _flatten_tokens(grad_output).sum(dim=0) if ctx.use_bias else None
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def _weight_gradient(ctx, weight: torch.Tensor, grad_output_2d: torch.Tensor,
                     input_2d: torch.Tensor) -> torch.Tensor | None:
    """``dW = dY^T X``; accumulated into ``weight.main_grad`` when fusion is on (returning no real ``.grad``).

    DDP's backward hook must then ignore the placeholder ``.grad`` returned here
    (:func:`~megatron_core.tensor_parallel.wgrad_accumulation.finish_fused_weight_gradient`).
    """
    if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
        if torch.compiler.is_compiling():
            torch.ops.megatron_core.accumulate_weight_gradient(weight.main_grad, grad_output_2d, input_2d)
        else:
            accumulate_weight_gradient(weight.main_grad, grad_output_2d, input_2d)
        return finish_fused_weight_gradient(weight)
    return grad_output_2d.t().matmul(input_2d)


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    async_grad_allreduce: bool | None = None,
    tp_group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``input @ weight^T + bias`` with tensor-parallel communication folded into forward and backward.

    ``allreduce_dgrad``: all-reduce the input gradient over TP (column layer without sequence
    parallelism). ``sequence_parallel``: all-gather the input along dim 0 in forward and
    reduce-scatter its gradient in backward. ``grad_output_buffer``: when a list, the output
    gradients are appended to it and the weight gradient is left to the caller (deferred wgrad).
    ``async_grad_allreduce`` is the deprecated name of ``allreduce_dgrad``.
    """
    if async_grad_allreduce is not None:
        allreduce_dgrad = async_grad_allreduce
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("allreduce_dgrad and sequence_parallel cannot both be True")
    if not sequence_parallel and fused_gemv_supported(input, weight):
        # One row without grad (a decode step at batch 1): a GEMV kernel that streams the weight faster than
        # cuBLAS. The forward has no communication here without sequence parallelism.
        return fused_gemv(input, weight, bias)
    tp_group = resolve_tp_group(tp_group)
    if (get_pg_size(tp_group) == 1 and not gradient_accumulation_fusion and grad_output_buffer is None
            and not sequence_parallel):
        # Nothing to communicate or fuse: plain autograd, which torch.compile traces without a break.
        return F.linear(input, weight, bias)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit or 0, tp_group,
    )
