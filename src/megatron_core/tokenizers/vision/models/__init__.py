"""Vision tokenizer classes, one per metadata ``model_type``."""

from megatron_core.tokenizers.vision.models.default_tokenizer import DefaultTokenizerVision

__all__ = ["DefaultTokenizerVision"]
