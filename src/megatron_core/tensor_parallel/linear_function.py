"""The matmul autograd op behind the parallel linear layers, with its tensor-parallel communication.

``linear_with_grad_accumulation_and_async_allreduce`` is Megatron-Core's core op. Forward: with
sequence parallelism, all-gather the input along the sequence dim first; then ``x @ W^T + b``.
Backward: the input gradient is all-reduced over TP (``allreduce_dgrad``) or reduce-scattered
along the sequence (sequence parallel); the weight gradient goes to ``weight.main_grad`` (fp32)
when ``gradient_accumulation_fusion`` is on and the parameter has one, as Megatron's fused wgrad
kernel does, else to ``weight.grad`` as usual. With sequence parallelism the gathered input is
not kept: backward gathers it again, trading a second all-gather for activation memory.
With a tensor-parallel group of one and nothing to fuse or defer, the op is plain ``F.linear``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core.tensor_parallel.groups import get_tensor_model_parallel_group_if_none, group_size
from megatron_core.tensor_parallel.mappings import (
    _all_reduce,
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
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


_FP32_ACCUMULATING_GEMM: dict[str, bool] = {}


def _gemm_accumulates_into_fp32(device: torch.device) -> bool:
    """Whether ``addmm(fp32, bf16, bf16, out_dtype=fp32, out=fp32)`` works on ``device`` (checked once, on CUDA).

    Newer PyTorch builds run it on CUDA as one cuBLAS GEMM with an fp32 C operand; the check compares a
    small product against the two-step result, so a build without it (or a wrong one) keeps the fallback.
    """
    if device.type != "cuda":
        return False
    key = str(device)
    if torch.compiler.is_compiling():  # traced backward: use what an eager call found (see warm_up_...)
        return _FP32_ACCUMULATING_GEMM.get(key, False)
    if key not in _FP32_ACCUMULATING_GEMM:
        try:
            a = torch.randn(64, 32, device=device, dtype=torch.bfloat16)
            b = torch.randn(32, 48, device=device, dtype=torch.bfloat16)
            acc = torch.randn(64, 48, device=device, dtype=torch.float32)
            want = acc + (a @ b).float()
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.allclose(acc, want, rtol=2e-2, atol=2e-1))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _FP32_ACCUMULATING_GEMM[key] = ok
    return _FP32_ACCUMULATING_GEMM[key]


def warm_up_fp32_accumulating_gemm(device: torch.device) -> None:
    """Run the one-time check of :func:`_gemm_accumulates_into_fp32` eagerly (before any ``torch.compile``)."""
    _gemm_accumulates_into_fp32(torch.device(device))


def _weight_gradient(ctx, weight: torch.Tensor, grad_output_2d: torch.Tensor,
                     input_2d: torch.Tensor) -> torch.Tensor | None:
    """``dW = dY^T X``; accumulated into ``weight.main_grad`` when fusion is on (returning no ``.grad``)."""
    if ctx.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
        main_grad = weight.main_grad
        if main_grad.dtype == grad_output_2d.dtype:
            main_grad.addmm_(grad_output_2d.t(), input_2d)  # one GEMM that accumulates in place
        elif _gemm_accumulates_into_fp32(main_grad.device):
            # bf16/fp16 operands on tensor cores, the product added to the fp32 main_grad inside the GEMM.
            torch.addmm(main_grad, grad_output_2d.t(), input_2d, out_dtype=main_grad.dtype, out=main_grad)
        else:
            # bf16/fp16 activations with an fp32 main_grad: the GEMM runs in the activation dtype (tensor
            # cores, fp32 accumulation inside) and its result is added in fp32, as the unfused DDP hook does;
            # upcasting the operands instead would run the GEMM in fp32, many times slower on a GPU.
            main_grad.add_(grad_output_2d.t().matmul(input_2d))
        if hasattr(weight, "grad_added_to_main_grad"):
            # DDP's backward hook reads this flag; it then ignores the (dummy) .grad returned here.
            weight.grad_added_to_main_grad = True
            if getattr(weight, "zero_out_wgrad", False):
                return torch.zeros_like(weight)
            return torch.empty_like(weight)
        return None
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
    tp_group = get_tensor_model_parallel_group_if_none(tp_group)
    if (group_size(tp_group) == 1 and not gradient_accumulation_fusion and grad_output_buffer is None
            and not sequence_parallel):
        # Nothing to communicate or fuse: plain autograd, which torch.compile traces without a break.
        return F.linear(input, weight, bias)
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
        grad_output_buffer, wgrad_deferral_limit or 0, tp_group,
    )
