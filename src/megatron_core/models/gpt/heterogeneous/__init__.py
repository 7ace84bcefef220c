"""Layer specs of heterogeneous GPT models (``megatron.core.models.gpt.heterogeneous``)."""
