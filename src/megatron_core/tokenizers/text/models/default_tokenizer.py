"""``DefaultTokenizerText``: the default text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class DefaultTokenizerText(MegatronTokenizerText):
    """Text tokenizer for default models."""
