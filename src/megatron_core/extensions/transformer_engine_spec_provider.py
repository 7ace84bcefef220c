"""``TESpecProvider``: the Transformer Engine backend of the spec functions (Megatron-Core's class of that name).

It names the wrappers of :mod:`megatron_core.extensions.transformer_engine` for each slot of a layer
spec: the norm is fused into the following column-parallel linear (``TELayerNormColumnParallelLinear``),
so a TE layer has no separate ``input_layernorm`` / ``pre_mlp_layernorm`` and needs no checkpoint key
map. Importing this module and building specs from it never needs Transformer Engine; building a model
from such a spec without it raises the ``ImportError`` naming the ``te`` extra. As with the wrappers,
this path has not run against Transformer Engine in this project's CI (docs/compat.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from megatron_core.extensions.transformer_engine import (
    TEColumnParallelGroupedLinear,
    TEColumnParallelLinear,
    TEDotProductAttention,
    TELayerNormColumnParallelLinear,
    TENorm,
    TERowParallelGroupedLinear,
    TERowParallelLinear,
)
from megatron_core.transformer.backends import experts_spec

__all__ = ["TESpecProvider"]


class TESpecProvider:
    """Transformer Engine modules for every slot (a :class:`~megatron_core.models.backends.BackendSpecProvider`)."""

    def column_parallel_linear(self) -> type:
        """``TEColumnParallelLinear``."""
        return TEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        """``TERowParallelLinear``."""
        return TERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        """Transformer Engine fuses each pre-norm into the following linear layer."""
        return True

    def column_parallel_layer_norm_linear(self) -> type | None:
        """``TELayerNormColumnParallelLinear`` (norm + column-parallel linear in one module)."""
        return TELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        """``TENorm`` (LayerNorm or RMSNorm from ``config.normalization``)."""
        return TENorm

    def core_attention(self) -> type:
        """``TEDotProductAttention``."""
        return TEDotProductAttention

    def activation_func(self) -> Callable | None:
        """Use ``config.activation_func``."""
        return None

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool) -> Any:
        """Routed experts: ``TEGroupedMLP`` on TE's grouped linears, or ``SequentialMLP`` on TE linears."""
        return experts_spec(moe_use_grouped_gemm, (TEColumnParallelLinear, TERowParallelLinear),
                            (TEColumnParallelGroupedLinear, TERowParallelGroupedLinear))
