"""Tokens-per-expert counts read on the host, refused by name inside a CUDA graph capture.

Where a rank holds every expert and each token has exactly top-k rows (or every expert is padded to its capacity),
the MoE layer's shapes never depend on the routing and the counts stay on the device, so the whole layer can be
captured (``cuda_graph_impl="full_iteration"``). Every other path reads the counts on the host, which a capture
forbids; these helpers say which path did it and what a captured MoE layer needs, instead of CUDA's bare "operation
not permitted when stream is capturing".
"""

from __future__ import annotations

import torch

from megatron_core import device

__all__ = ["CAPTURABLE_MOE_RULE", "counts_to_host", "refuse_host_counts_while_capturing"]

CAPTURABLE_MOE_RULE = (
    "a captured MoE layer needs every expert on this rank (expert-parallel x expert-tensor-parallel size 1), the "
    "grouped experts (moe_grouped_gemm=True) in bf16 or fp16, and either dropless top-k routing (no "
    "moe_expert_capacity_factor, no moe_router_padding_for_quantization) or moe_pad_expert_input_to_capacity=True"
)
"""What keeps the counts on the device (the rule :func:`refuse_host_counts_while_capturing` states)."""


def refuse_host_counts_while_capturing(counts: torch.Tensor, where: str) -> None:
    """Raise ``RuntimeError`` naming ``where`` if ``counts`` (a device tensor about to be read on the host) sits on
    a CUDA stream being captured into a graph; otherwise do nothing."""
    if device.is_capturing(counts):
        raise RuntimeError(f"{where} reads the tokens-per-expert counts on the host, which a CUDA graph capture "
                           f"forbids: {CAPTURABLE_MOE_RULE}")


def counts_to_host(counts: torch.Tensor, where: str) -> list[int]:
    """``counts.tolist()``, refused by name inside a CUDA graph capture (:func:`refuse_host_counts_while_capturing`)."""
    refuse_host_counts_while_capturing(counts, where)
    return counts.tolist()
