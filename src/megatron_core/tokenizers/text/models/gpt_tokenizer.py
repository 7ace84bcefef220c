"""``GPTTokenizer``: the GPT text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class GPTTokenizer(MegatronTokenizerText):
    """Text tokenizer for GPT models."""
