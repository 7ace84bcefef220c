"""``T5Tokenizer``: the T5 text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class T5Tokenizer(MegatronTokenizerText):
    """Text tokenizer for T5 models."""
