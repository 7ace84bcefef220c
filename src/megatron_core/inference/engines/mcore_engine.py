"""Megatron-Core's legacy name for the static engine: ``MCoreEngine`` is
:class:`megatron_core.inference.engines.static_engine.StaticInferenceEngine` (the same class, as in Megatron-Core
0.19)."""

from megatron_core.inference.engines.static_engine import StaticInferenceEngine as MCoreEngine

__all__ = ["MCoreEngine"]
