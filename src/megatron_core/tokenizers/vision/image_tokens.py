"""The image placeholder that multimodal text carries, shared by the vision tokenizers and LLaVA.

A prompt holds one ``IMAGE_TOKEN`` per image. The tokenizers encode it as a single id (an added
special token for ``multimodal``, ``DEFAULT_IMAGE_TOKEN_INDEX`` for ``null-multimodal``); the model
(:class:`~megatron_core.models.multimodal.llava_model.LLaVAModel`, ``image_token_index``) later gives
that one position all of the image's tile embeddings. ``llava_model`` re-exports both names at
Megatron-Core's paths.
"""

from __future__ import annotations

__all__ = ["DEFAULT_IMAGE_TOKEN_INDEX", "IMAGE_TOKEN"]

IMAGE_TOKEN = "<image>"
"""Text of the image placeholder."""

DEFAULT_IMAGE_TOKEN_INDEX = -200
"""Image id when the tokenizer has none of its own (pass ``image_token_index`` for real tokenizers)."""
