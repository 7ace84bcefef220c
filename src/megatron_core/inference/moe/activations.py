"""Padding-aware activations for the fused inference MoE (Megatron-Core's ``inference.moe.activations``).

They act on the expert-grouped rows of :func:`~megatron_core.inference.moe.permute.permute_tokens`: rows
``>= n_used`` and alignment-padding rows (``permutation_map == -1``) are skipped. Megatron-Core's Triton
kernels leave those rows unwritten; here they are zero. The MXFP8 variant is not provided.
"""

from __future__ import annotations

import torch

from megatron_core.inference.moe.permute import MXFP8_REFUSAL

__all__ = ["padded_squared_relu", "squared_relu_and_quantize_mxfp8"]


def used_rows(permutation_map: torch.Tensor, n_used: torch.Tensor) -> torch.Tensor:
    """``[R]`` bool: rows below ``n_used`` that hold a token (not alignment padding)."""
    rows = torch.arange(permutation_map.shape[0], device=permutation_map.device)
    return (rows < n_used.reshape(-1)[:1].to(rows.device)) & (permutation_map >= 0)


def padded_squared_relu(x: torch.Tensor, permutation_map: torch.Tensor, n_used: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` computed in fp32 and stored in ``x``'s dtype on the used rows of ``x [R, n]``; zero elsewhere."""
    activated = torch.relu(x.float()).square().to(x.dtype)
    return torch.where(used_rows(permutation_map, n_used)[:, None], activated, torch.zeros((), dtype=x.dtype,
                                                                                          device=x.device))


def squared_relu_and_quantize_mxfp8(x: torch.Tensor, permutation_map: torch.Tensor, n_used: torch.Tensor):
    """Megatron-Core's fused squared ReLU + MXFP8 quantization: raises ``NotImplementedError`` (not provided)."""
    raise NotImplementedError(f"squared_relu_and_quantize_mxfp8: {MXFP8_REFUSAL}")
