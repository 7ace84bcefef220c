"""``BertTokenizer``: the BERT text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class BertTokenizer(MegatronTokenizerText):
    """Text tokenizer for BERT models."""
