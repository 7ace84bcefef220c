"""Text tokenizers: :class:`MegatronTokenizerText` over one library tokenizer."""

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText

__all__ = ["MegatronTokenizerText"]
