"""Older path of :mod:`megatron_core.tokenizers.legacy.optional`."""

from megatron_core.tokenizers.legacy.optional import _require as _require
from megatron_core.tokenizers.legacy.optional import import_sentencepiece, import_tiktoken, import_tokenizers

__all__ = ["import_sentencepiece", "import_tiktoken", "import_tokenizers"]
