"""``LanguageModule``: loss computation and tied embeddings for language models."""

from megatron_core.models.common.language_module.language_module import LanguageModule

__all__ = ["LanguageModule"]
