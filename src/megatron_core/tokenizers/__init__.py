"""Megatron-Core 0.19's tokenizer package: ``MegatronTokenizer.from_pretrained`` and its metadata.

A tokenizer is described by a small metadata dict (or the JSON file ``tokenizer_metadata.json`` next
to the tokenizer files) naming its ``library`` (``"huggingface"``, ``"sentencepiece"``, ``"tiktoken"``,
``"megatron"``, ``"byte-level"``, ``"null-text"``) and optionally a ``model_type`` and a chat template.
The libraries are the tokenizers of :mod:`megatron_core.tokenizers.legacy`, wrapped in one text
tokenizer class (:class:`~megatron_core.tokenizers.text.MegatronTokenizerText`).
"""

from megatron_core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron_core.tokenizers.megatron_tokenizer import MegatronTokenizer

__all__ = ["MegatronTokenizer", "MegatronTokenizerBase"]
