"""Megatron-Core's ``transformer.torch_layer_norm``: ``WrappedTorchLayerNorm``, the former name of ``WrappedTorchNorm``."""

from megatron_core.transformer.torch_norm import WrappedTorchNorm

WrappedTorchLayerNorm = WrappedTorchNorm

__all__ = ["WrappedTorchLayerNorm"]
