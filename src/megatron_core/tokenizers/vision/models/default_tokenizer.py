"""``DefaultTokenizerVision``: the default vision tokenizer (``model_type`` ``"default-vision"``)."""

from __future__ import annotations

from megatron_core.tokenizers.vision.vision_tokenizer import MegatronTokenizerVision


class DefaultTokenizerVision(MegatronTokenizerVision):
    """Vision tokenizer for default models."""
