"""Megatron-Core's experimental attention variants: only the DeepSeek-sparse-attention loss scaler is provided.

The DSA attention itself (its indexer and top-k sparse attention) is not implemented here (docs/compat.md);
:class:`~megatron_core.transformer.experimental_attention_variant.dsa.DSAIndexerLossAutoScaler` is, so that
the schedules can set the indexer loss's backward scale as Megatron-Core's do.
"""
