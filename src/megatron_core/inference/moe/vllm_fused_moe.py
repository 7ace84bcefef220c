"""The vLLM-style fused inference MoE (Megatron-Core's ``inference.moe.vllm_fused_moe``), in PyTorch.

Megatron-Core ships its own Triton kernel adapted from vLLM's fused MoE (vLLM itself is not imported): FC1
with the squared ReLU applied to its fp32 accumulator, FC2 without routing weights, then a reduction over
the top-k slots that multiplies by the probabilities in fp32. The same computation is written here on
:mod:`.permute`'s expert-grouped rows: FC1 accumulates in fp32 (inputs upcast), the activation is applied
there and stored in the input dtype, FC2 runs in the input dtype, and the weighted top-k sum is fp32.
"""

from __future__ import annotations

import torch

from megatron_core.inference.moe.activations import used_rows
from megatron_core.inference.moe.fused_moe import (
    GROUPED_MM_ALIGNMENT,
    ActivationType,
    check_expert_weights,
    grouped_matmul,
    uses_grouped_mm,
)
from megatron_core.inference.moe.permute import permute_tokens, unpermute_tokens

__all__ = ["vllm_fused_moe"]


def vllm_fused_moe(hidden_states: torch.Tensor, probs: torch.Tensor, fc1_weight: torch.Tensor,
                   fc2_weight: torch.Tensor, activation_type: ActivationType, num_local_experts: int,
                   local_expert_start: int, valid_tokens: torch.Tensor, routing_map: torch.Tensor,
                   out: torch.Tensor | None = None, num_tokens_hint: int | None = None) -> torch.Tensor:
    """Each valid token's sum over its local slots of ``prob * FC2(relu(FC1(x))**2)``: ``[max_tokens, h]``.

    fp32 when ``out`` is None (rows ``>= valid_tokens`` zero), else written into ``out`` (its dtype; rows
    ``>= valid_tokens`` untouched). ``num_tokens_hint`` picks Triton tile sizes in Megatron-Core and has no
    effect here. Only ``ActivationType.SQUARED_RELU`` exists, as there.
    """
    check_expert_weights(fc1_weight, fc2_weight, num_local_experts)
    if activation_type != ActivationType.SQUARED_RELU:
        raise ValueError(f"vllm_fused_moe: activation_type ({activation_type!r}) must be "
                         "ActivationType.SQUARED_RELU")
    dtype = hidden_states.dtype
    alignment = GROUPED_MM_ALIGNMENT if uses_grouped_mm(hidden_states, fc2_weight) else 1
    permuted, permuted_probs, permutation_map, offs = permute_tokens(
        hidden_states, probs.float(), routing_map, local_expert_start, num_local_experts, valid_tokens, alignment)
    n_used = offs[-1:]
    fc1_fp32 = grouped_matmul(permuted.float(), fc1_weight.float(), offs)
    activated = torch.relu(fc1_fp32).square().to(dtype)
    activated = torch.where(used_rows(permutation_map, n_used)[:, None], activated,
                            torch.zeros((), dtype=dtype, device=activated.device))
    fc2_output = grouped_matmul(activated, fc2_weight.to(dtype), offs)
    result = unpermute_tokens(fc2_output, permuted_probs, permutation_map, hidden_states.shape[0], n_used,
                              valid_tokens)
    if out is None:
        return result
    rows = torch.arange(out.shape[0], device=out.device)
    valid = (rows < valid_tokens.reshape(-1)[:1].to(out.device))[:, None]
    out.copy_(torch.where(valid, result.to(out.dtype), out))
    return out
