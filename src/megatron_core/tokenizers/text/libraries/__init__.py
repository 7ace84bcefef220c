"""Library tokenizers behind :class:`~megatron_core.tokenizers.text.MegatronTokenizerText`.

Each adapts one of :mod:`megatron_core.tokenizers.legacy` to the constructor arguments Megatron's
tokenizer metadata libraries take (``"huggingface"``, ``"megatron"``, ``"sentencepiece"``,
``"tiktoken"``, ``"null-text"``); ``ByteLevelTokenizer`` is the ``"byte-level"`` library and
``SFTTokenizer`` the ``"sft"`` library (conversations to ids and loss targets).
"""

from megatron_core.tokenizers.text.libraries.bytelevel_tokenizer import ByteLevelTokenizer
from megatron_core.tokenizers.text.libraries.huggingface_tokenizer import HuggingFaceTokenizer
from megatron_core.tokenizers.text.libraries.megatron_hf_tokenizer import MegatronHFTokenizer
from megatron_core.tokenizers.text.libraries.null_tokenizer import NullTokenizer
from megatron_core.tokenizers.text.libraries.sentencepiece_tokenizer import SentencePieceTokenizer
from megatron_core.tokenizers.text.libraries.sft_tokenizer import SFTTokenizer
from megatron_core.tokenizers.text.libraries.tiktoken_tokenizer import TikTokenTokenizer

__all__ = [
    "ByteLevelTokenizer",
    "HuggingFaceTokenizer",
    "MegatronHFTokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "SFTTokenizer",
    "TikTokenTokenizer",
]
