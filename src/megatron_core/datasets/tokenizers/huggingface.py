"""Older path of :mod:`megatron_core.tokenizers.legacy.huggingface`."""

from megatron_core.tokenizers.legacy.huggingface import HuggingFaceTokenizer

__all__ = ["HuggingFaceTokenizer"]
