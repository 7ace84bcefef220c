"""Multimodal models (``megatron.core.models.multimodal``): LLaVA and its sequence/context-parallel helpers."""

from megatron_core.models.multimodal.llava_model import LLaVAModel

__all__ = ["LLaVAModel"]
