"""Library tokenizers behind :class:`~megatron_core.tokenizers.vision.MegatronTokenizerVision`.

``MegatronMultimodalTokenizer`` is the ``"multimodal"`` library (chat conversations with images to
ids and loss targets) and ``MegatronNullMultimodalTokenizer`` the ``"null-multimodal"`` library.
"""

from megatron_core.tokenizers.vision.libraries.multimodal_tokenizer import MegatronMultimodalTokenizer
from megatron_core.tokenizers.vision.libraries.null_multimodal_tokenizer import (
    MegatronNullMultimodalTokenizer,
)

__all__ = ["MegatronMultimodalTokenizer", "MegatronNullMultimodalTokenizer"]
