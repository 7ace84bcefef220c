"""The one place that imports the optional tokenizer libraries (``pip install megatron-core-lite[hf]``).

Each function imports its library on first use and turns a missing install into an ``ImportError``
that names the package and the extra, so ``import megatron_core`` never needs them.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def _require(module: str, package: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ImportError(
            f"{what} needs the '{package}' package: pip install {package} (or pip install 'megatron-core-lite[hf]')"
        ) from error


def import_tokenizers() -> ModuleType:
    """Hugging Face ``tokenizers``."""
    return _require("tokenizers", "tokenizers", "HuggingFaceTokenizer / train_bpe_tokenizer")


def import_tiktoken() -> ModuleType:
    """OpenAI ``tiktoken``."""
    return _require("tiktoken", "tiktoken", "TikTokenizer")


def import_sentencepiece() -> ModuleType:
    """Google ``sentencepiece``."""
    return _require("sentencepiece", "sentencepiece", "SentencePieceTokenizer")
