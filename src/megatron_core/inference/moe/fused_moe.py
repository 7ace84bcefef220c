"""Fused inference MoE: permute -> FC1 -> activation -> FC2 -> unpermute (Megatron-Core's ``mcore_fused_moe``).

``fc1_weight [E, ffn, h]`` and ``fc2_weight [E, h, ffn]`` are the local experts' stacked weights; the routing
is dense (``routing_map [max_tokens, topk]`` of global expert ids, ``probs [max_tokens, topk]``). The GEMMs
run as one ``grouped_mm`` over the expert blocks on CUDA with bf16/fp16 operands and 16-byte aligned weights
(where torch has it; each expert block then starts at a multiple of 16 rows, as in Megatron-Core) and as one
GEMM per expert otherwise, which reads the block offsets back to the host. Megatron-Core takes bf16 only; any float dtype is accepted here
(fp32 is exact against a per-expert loop). MXFP8 weights are not provided.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.inference.moe.activations import padded_squared_relu
from megatron_core.inference.moe.permute import MXFP8_REFUSAL, permute_tokens, unpermute_tokens

__all__ = ["ActivationType", "mcore_fused_moe"]

_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
GROUPED_MM_ALIGNMENT = 16


class ActivationType(Enum):
    """Activations of the fused inference MoE."""

    SQUARED_RELU = "squared_relu"


def uses_grouped_mm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x`` times the stacked ``weight [E, out, in]`` runs as one torch ``grouped_mm``: CUDA, bf16/fp16,
    16-byte aligned weight rows and columns, and a torch that has it."""
    if _GROUPED_MM is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    elems = 16 // x.element_size()
    return weight.shape[1] % elems == 0 and weight.shape[2] % elems == 0


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x [R, in]`` rows of expert ``e`` (up to ``offs[e]``) times ``weight[e].T`` (``weight [E, out, in]``).

    Rows past ``offs[-1]`` are zero.
    """
    if uses_grouped_mm(x, weight):
        out = _GROUPED_MM(x, weight.transpose(1, 2), offs=offs.to(torch.int32))
        rows = torch.arange(x.shape[0], device=x.device)
        return torch.where((rows < offs[-1:])[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    out = x.new_zeros(x.shape[0], weight.shape[1])
    start = 0
    for expert, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ weight[expert].t()
        start = end
    return out


def activation_function(activation_type: ActivationType) -> Callable:
    """The padding-aware kernel of ``activation_type`` (``ValueError`` for any other value)."""
    if activation_type == ActivationType.SQUARED_RELU:
        return padded_squared_relu
    raise ValueError(f"activation_type ({activation_type!r}) must be one of {[a.name for a in ActivationType]}")


def check_expert_weights(fc1_weight: Any, fc2_weight: Any, num_local_experts: int) -> None:
    """Both weights stacked ``[num_local_experts, out, in]`` tensors (MXFP8 weights are refused)."""
    for name, weight in (("fc1_weight", fc1_weight), ("fc2_weight", fc2_weight)):
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            raise NotImplementedError(f"{name} must be a stacked [experts, out, in] tensor ({MXFP8_REFUSAL})")
        if weight.shape[0] != num_local_experts:
            raise ValueError(f"{name} has {weight.shape[0]} experts, expected num_local_experts "
                             f"({num_local_experts})")


def mcore_fused_moe(hidden_states: torch.Tensor, probs: torch.Tensor, fc1_weight: torch.Tensor,
                    fc2_weight: torch.Tensor, activation_type: ActivationType, num_local_experts: int,
                    local_expert_start: int, valid_tokens: torch.Tensor, routing_map: torch.Tensor,
                    disable_fused_quant_kernels: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """Each valid token's sum over its slots on local experts of ``prob * FC2(act(FC1(x)))``, fp32.

    Returns ``[max_tokens, h]`` fp32 (``out`` when given, rows ``>= valid_tokens`` left as they were; else a new
    buffer with those rows zero). ``probs`` must be fp32. ``disable_fused_quant_kernels`` only concerns MXFP8
    weights in Megatron-Core and has no effect here.
    """
    check_expert_weights(fc1_weight, fc2_weight, num_local_experts)
    if not hidden_states.is_floating_point():
        raise ValueError(f"mcore_fused_moe: hidden_states must be floating point, got {hidden_states.dtype}")
    activation = activation_function(activation_type)
    alignment = GROUPED_MM_ALIGNMENT if uses_grouped_mm(hidden_states, fc1_weight) else 1
    permuted, permuted_probs, permutation_map, offs = permute_tokens(
        hidden_states, probs, routing_map, local_expert_start, num_local_experts, valid_tokens, alignment)
    n_used = offs[-1:]
    fc1_output = grouped_matmul(permuted, fc1_weight.to(permuted.dtype), offs)
    fc2_output = grouped_matmul(activation(fc1_output, permutation_map, n_used), fc2_weight.to(permuted.dtype), offs)
    return unpermute_tokens(fc2_output, permuted_probs, permutation_map, hidden_states.shape[0], n_used,
                            valid_tokens, out=out)
