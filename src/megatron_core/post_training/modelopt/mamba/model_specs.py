"""Megatron-Core's earlier path of :mod:`megatron_core.post_training.modelopt.hybrid.model_specs` (same objects)."""

from __future__ import annotations

from megatron_core.post_training.modelopt.hybrid.model_specs import (
    get_hybrid_stack_modelopt_spec,
    get_mamba_stack_modelopt_spec,
    hybrid_stack_spec_no_moe_grouped_gemm,
)

__all__ = ["get_hybrid_stack_modelopt_spec", "get_mamba_stack_modelopt_spec", "hybrid_stack_spec_no_moe_grouped_gemm"]
