"""Deferred weight gradients of the output layer (``defer_embedding_wgrad_compute``), computed after the last
micro-batch's backward: Megatron-Core's ``drain_embedding_wgrad_compute``.

A ``ColumnParallelLinear`` given ``embedding_activation_buffer`` / ``grad_output_buffer`` appends each
micro-batch's input (before the sequence-parallel all-gather) and output gradient instead of forming
``dW = dY^T X``; the pipeline schedule then calls :func:`drain_embedding_wgrad_compute`, which empties both
buffers pairwise. With ``gradient_accumulation_fusion`` and a ``main_grad`` (DDP) each product is added to
``weight.main_grad``; otherwise to ``weight.grad`` (Megatron-Core needs the fusion for deferral).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core.tensor_parallel.mappings import _gather_along_first_dim
from megatron_core.tensor_parallel.wgrad_accumulation import accumulate_weight_gradient

__all__ = ["drain_embedding_wgrad_compute", "prepare_input_tensors_for_wgrad_compute"]


def prepare_input_tensors_for_wgrad_compute(grad_output: torch.Tensor,
                                            all_gathered_input: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(grad_output, input)`` made contiguous, and ``[s, b, h]`` tensors flattened to ``[s * b, h]`` for the
    weight-gradient GEMM (2-D tensors stay as they are)."""
    grad_output = grad_output.contiguous()
    all_gathered_input = all_gathered_input.contiguous()
    if grad_output.dim() == 3:
        grad_output = grad_output.view(-1, grad_output.shape[2])
        all_gathered_input = all_gathered_input.view(-1, all_gathered_input.shape[2])
    return grad_output, all_gathered_input


def _add_weight_gradient(config: Any, weight: torch.Tensor, grad_output: torch.Tensor,
                         total_input: torch.Tensor) -> None:
    grad_output, total_input = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
    if getattr(weight, "__fsdp_param__", False) and hasattr(weight, "get_main_grad"):
        weight.main_grad = weight.get_main_grad()
    if config.gradient_accumulation_fusion and hasattr(weight, "main_grad"):
        accumulate_weight_gradient(weight.main_grad, grad_output, total_input)
        return
    product = grad_output.t().matmul(total_input).to(weight.dtype)
    if weight.grad is None:
        weight.grad = product
    else:
        weight.grad.add_(product)


@torch.no_grad()
def drain_embedding_wgrad_compute(config: Any, embedding_activation_buffer: list[torch.Tensor],
                                  grad_output_buffer: list[torch.Tensor], weight: torch.Tensor,
                                  tp_group: dist.ProcessGroup | None) -> None:
    """Add every deferred ``grad_output^T @ input`` to ``weight``'s gradient, emptying both buffers.

    Under ``config.sequence_parallel`` each stored input is all-gathered over ``tp_group`` first (collective:
    every rank of the group drains the same number of micro-batches). The buffers must be equally long
    (``ValueError`` otherwise).
    """
    if len(embedding_activation_buffer) != len(grad_output_buffer):
        raise ValueError(
            f"drain_embedding_wgrad_compute: embedding_activation_buffer ({len(embedding_activation_buffer)} "
            f"tensors) and grad_output_buffer ({len(grad_output_buffer)}) must be equally long"
        )
    while embedding_activation_buffer:
        activation = embedding_activation_buffer.pop(0)
        grad_output = grad_output_buffer.pop(0)
        total_input = _gather_along_first_dim(activation, tp_group) if config.sequence_parallel else activation
        _add_weight_gradient(config, weight, grad_output, total_input)
