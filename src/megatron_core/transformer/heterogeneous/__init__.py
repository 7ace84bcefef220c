"""Heterogeneous transformers, whose layers differ (``megatron.core.transformer.heterogeneous``): per-layer
configs read from Hugging Face DeciLM ``block_configs`` and the linear that replaces a block's attention or MLP."""
