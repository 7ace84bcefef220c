"""The linear op for a frozen weight (``weight.requires_grad`` False): Megatron-Core's ``LinearWithFrozenWeight``.

It computes the same forward and input gradient as
:func:`~megatron_core.tensor_parallel.linear_function.linear_with_grad_accumulation_and_async_allreduce` but
keeps only the weight for backward (no input activations) and never forms a weight gradient. Communication:
with ``allreduce_dgrad`` the input gradient is all-reduced over the tensor-parallel group; with sequence
parallelism the input is all-gathered along the sequence before the matmul and its gradient reduce-scattered
back (the gather's own backward). ``ColumnParallelLinear`` / ``RowParallelLinear`` route frozen weights here.
A bias that requires grad gets its gradient (Megatron-Core 0.19 drops it). Without any communication to do the
op is plain ``F.linear`` (or the decode GEMV), as the trainable op is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core._ground import get_pg_size
from megatron_core.tensor_parallel.fused_gemv import fused_gemv, fused_gemv_supported
from megatron_core.tensor_parallel.groups import resolve_tp_group
from megatron_core.tensor_parallel.mappings import _all_reduce, gather_from_sequence_parallel_region

__all__ = ["LinearWithFrozenWeight", "linear_with_frozen_weight"]


class LinearWithFrozenWeight(torch.autograd.Function):
    """``input @ weight^T + bias`` whose backward returns only the input gradient (all-reduced over
    ``tp_group`` when ``allreduce_dgrad``); ``apply(input, weight, bias, allreduce_dgrad, tp_group)``."""

    @staticmethod
    def forward(ctx, input, weight, bias, allreduce_dgrad, tp_group):
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.tp_group = tp_group
        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (weight,) = ctx.saved_tensors
        # [..., out] -> [tokens, out] @ [out, in]: one GEMM whatever the leading dims
        grad_input = grad_output.reshape(-1, grad_output.size(-1)).matmul(weight)
        grad_input = grad_input.reshape(*grad_output.shape[:-1], weight.size(1))
        if ctx.allreduce_dgrad:
            grad_input = _all_reduce(grad_input, ctx.tp_group)
        grad_bias = grad_output.reshape(-1, grad_output.size(-1)).sum(dim=0) if ctx.needs_input_grad[2] else None
        return grad_input, None, grad_bias, None, None


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup | None,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    gtp_remat_size: int = 1,
) -> torch.Tensor:
    """The parallel linear op of a weight that gets no gradient (same arguments as the trainable op).

    ``gradient_accumulation_fusion`` is accepted and unused (there is no weight gradient to fuse).
    ``grad_output_buffer`` and ``wgrad_deferral_limit`` belong to deferred weight gradients and must be
    ``None``; ``allreduce_dgrad`` and ``sequence_parallel`` exclude each other; ``gtp_remat_size`` must be 1
    (generalized tensor parallelism is not implemented). Bad combinations raise ``ValueError``.
    """
    if grad_output_buffer is not None:
        raise ValueError("linear_with_frozen_weight: grad_output_buffer must be None (a frozen weight has no "
                         "weight gradient to defer)")
    if wgrad_deferral_limit is not None:
        raise ValueError(f"linear_with_frozen_weight: wgrad_deferral_limit ({wgrad_deferral_limit}) must be None")
    if allreduce_dgrad and sequence_parallel:
        raise ValueError("linear_with_frozen_weight: allreduce_dgrad and sequence_parallel cannot both be True")
    if gtp_remat_size != 1:
        raise ValueError(f"linear_with_frozen_weight: gtp_remat_size ({gtp_remat_size}) must be 1")
    tp_group = resolve_tp_group(tp_group)
    if not sequence_parallel and (not allreduce_dgrad or get_pg_size(tp_group) == 1):
        # Nothing to communicate: the same values and input gradient from plain autograd (compile friendly).
        return fused_gemv(input, weight, bias) if fused_gemv_supported(input, weight) else F.linear(input, weight, bias)
    if sequence_parallel:
        input = gather_from_sequence_parallel_region(input, tensor_parallel_output_grad=True, group=tp_group)
    return LinearWithFrozenWeight.apply(input, weight, bias, allreduce_dgrad, tp_group)
