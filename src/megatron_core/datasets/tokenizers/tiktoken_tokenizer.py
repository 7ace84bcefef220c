"""Older path of :mod:`megatron_core.tokenizers.legacy.tiktoken_tokenizer`."""

from megatron_core.tokenizers.legacy.tiktoken_tokenizer import (
    PATTERN_TIKTOKEN_V1,
    PATTERN_TIKTOKEN_V2,
    SPECIAL_TOKENS,
    TikTokenizer,
    load_tiktoken_ranks,
)

__all__ = ["PATTERN_TIKTOKEN_V1", "PATTERN_TIKTOKEN_V2", "SPECIAL_TOKENS", "TikTokenizer", "load_tiktoken_ranks"]
