"""Megatron-Core 0.19's tokenizer package: ``MegatronTokenizer.from_pretrained`` and its metadata.

A tokenizer is described by a small metadata dict (or the JSON file ``tokenizer_metadata.json`` next
to the tokenizer files) naming its ``library`` (``"huggingface"``, ``"sentencepiece"``, ``"tiktoken"``,
``"megatron"``, ``"byte-level"``, ``"null-text"``, ``"sft"``; the vision libraries ``"multimodal"`` and
``"null-multimodal"``) and optionally a ``model_type`` and a chat template. Text libraries are wrapped
in :class:`~megatron_core.tokenizers.text.MegatronTokenizerText`, vision libraries in
:class:`~megatron_core.tokenizers.vision.MegatronTokenizerVision`.
"""

from megatron_core.tokenizers.base_tokenizer import MegatronTokenizerBase
from megatron_core.tokenizers.megatron_tokenizer import MegatronTokenizer

__all__ = ["MegatronTokenizer", "MegatronTokenizerBase"]
