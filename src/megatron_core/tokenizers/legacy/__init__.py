"""Megatron's legacy tokenizers (``--tokenizer-type``, ``--legacy-tokenizer``): one interface, ``MegatronTokenizer``.

Each tokenizer is implemented here once; the libraries of :mod:`megatron_core.tokenizers.text.libraries`
(Megatron-Core 0.19's metadata API) adapt these classes. GPT-2 BPE and the null tokenizer are pure Python;
the Hugging Face, tiktoken and SentencePiece tokenizers import their libraries lazily (``pip install
megatron-core-lite[hf]``). ``megatron_core.datasets.tokenizers`` (the path datasets and
``preprocess_data`` use) re-exports this package.
"""

from megatron_core.tokenizers.legacy.build import TOKENIZER_TYPES, build_tokenizer
from megatron_core.tokenizers.legacy.gpt2_bpe import GPT2BPETokenizer
from megatron_core.tokenizers.legacy.huggingface import HuggingFaceTokenizer
from megatron_core.tokenizers.legacy.megatron_tokenizer import MegatronTokenizer
from megatron_core.tokenizers.legacy.null import NullTokenizer
from megatron_core.tokenizers.legacy.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron_core.tokenizers.legacy.tiktoken_tokenizer import TikTokenizer
from megatron_core.tokenizers.legacy.train import train_bpe_tokenizer

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
