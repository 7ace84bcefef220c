"""``MambaTokenizer``: the Mamba text tokenizer (``model_type`` metadata)."""

from __future__ import annotations

from megatron_core.tokenizers.text.text_tokenizer import MegatronTokenizerText


class MambaTokenizer(MegatronTokenizerText):
    """Text tokenizer for Mamba models."""
