"""Megatron-Core's legacy name for the static inference context: ``InferenceParams`` is
:class:`megatron_core.inference.contexts.StaticInferenceContext` (the same class, as in Megatron-Core 0.19)."""

from megatron_core.inference.contexts import StaticInferenceContext as InferenceParams

__all__ = ["InferenceParams"]
