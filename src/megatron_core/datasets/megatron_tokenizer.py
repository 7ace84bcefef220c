"""``MegatronTokenizer`` at Megatron-Core's older path; it lives in :mod:`megatron_core.tokenizers.legacy`."""

from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer

__all__ = ["MegatronTokenizer"]
