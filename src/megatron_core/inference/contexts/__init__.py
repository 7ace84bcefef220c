"""Inference contexts: the KV cache the model's attention reads and writes."""

from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.dynamic_context import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextOverflowError,
    DynamicInferenceContext,
    RequestOverflowError,
    TokenOverflowError,
)
from megatron_core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_core.inference.contexts.static_context import StaticInferenceContext

__all__ = [
    "ActiveRequestCountOverflowError",
    "BaseInferenceContext",
    "BlockOverflowError",
    "ContextOverflowError",
    "DynamicInferenceContext",
    "KVBlockAllocator",
    "RequestOverflowError",
    "StaticInferenceContext",
    "TokenOverflowError",
]
