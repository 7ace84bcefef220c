"""``FusedLayerNorm`` at Megatron-Core's path; the code lives in :mod:`megatron_core.transformer.fused_layer_norm`."""

from megatron_core.transformer.fused_layer_norm import FusedLayerNorm

__all__ = ["FusedLayerNorm"]
