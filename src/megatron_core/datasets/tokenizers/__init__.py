"""The legacy tokenizers (``--tokenizer-type``) at the path datasets and ``preprocess_data`` use; they live in
:mod:`megatron_core.tokenizers.legacy`, whose modules ``huggingface``, ``optional`` and ``tiktoken_tokenizer``
are also importable here."""

from megatron_core.tokenizers.legacy import *  # noqa: F403
from megatron_core.tokenizers.legacy import __all__ as __all__
