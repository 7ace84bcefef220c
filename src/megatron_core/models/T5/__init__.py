"""The T5 encoder-decoder model (``megatron.core.models.T5``)."""

from megatron_core.models.T5.t5_model import T5Model

__all__ = ["T5Model"]
