"""Vision tokenizers: :class:`MegatronTokenizerVision` over a multimodal library tokenizer.

The ``multimodal`` library renders chat conversations that carry ``<image>`` placeholders in one
of LLaVA's prompt formats, and the ``null-multimodal`` library reads ids written as text.
"""

from megatron_core.tokenizers.vision.vision_tokenizer import MegatronTokenizerVision

__all__ = ["MegatronTokenizerVision"]
