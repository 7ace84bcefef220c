"""Models built from transformer specs: ``GPTModel``, embeddings, backends (``megatron.core.models``)."""

from megatron_core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.models.gpt import GPTModel

__all__ = ["BackendSpecProvider", "GPTModel", "LocalSpecProvider"]
