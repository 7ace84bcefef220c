"""Tokenizers behind one interface (``MegatronTokenizer``), built by Megatron's ``--tokenizer-type`` names.

GPT-2 BPE and the null tokenizer are pure Python; the Hugging Face, tiktoken and SentencePiece
tokenizers import their libraries lazily (``pip install megatron-core-lite[hf]``).
"""

from megatron_core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron_core.datasets.tokenizers.build import TOKENIZER_TYPES, build_tokenizer
from megatron_core.datasets.tokenizers.gpt2_bpe import GPT2BPETokenizer
from megatron_core.datasets.tokenizers.huggingface import HuggingFaceTokenizer
from megatron_core.datasets.tokenizers.null import NullTokenizer
from megatron_core.datasets.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron_core.datasets.tokenizers.tiktoken_tokenizer import TikTokenizer
from megatron_core.datasets.tokenizers.train import train_bpe_tokenizer

__all__ = [
    "MegatronTokenizer",
    "TOKENIZER_TYPES",
    "build_tokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "train_bpe_tokenizer",
]
