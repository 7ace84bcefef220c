"""Inference configuration (Megatron-Core's ``inference.config.InferenceConfig``).

Sizes the dynamic engine: the paged KV cache (``block_size_tokens``, ``buffer_size_gb``), how
many requests and tokens one forward step may hold (``max_requests``, ``max_tokens``), the
longest sequence (``max_sequence_length``), and scheduling features (``enable_chunked_prefill``).
Fields that only matter to Megatron's CUDA kernels (flashinfer, unified memory, Mamba) are
accepted for signature compatibility and documented as inert in docs/compat.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

__all__ = ["InferenceConfig", "KVCacheManagementMode", "PrefixCachingEvictionPolicy"]


class PrefixCachingEvictionPolicy(str, Enum):
    """What happens to a cached prefix block whose reference count reaches zero."""

    REF_ZERO = "ref_zero"
    LRU = "lru"


class KVCacheManagementMode(str, Enum):
    """How the KV buffers are treated on suspend / resume."""

    PERSIST = "persist"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


@dataclass
class InferenceConfig:
    """Sizes and switches of the dynamic inference engine."""

    block_size_tokens: int = 256
    buffer_size_gb: float = 20
    paused_buffer_size_gb: float | None = None
    max_requests: int | None = None
    max_tokens: int | None = None
    max_sequence_length: int = 2560
    pg_collection: Any = None
    materialize_only_last_token_logits: bool = True
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    prefix_caching_eviction_policy: PrefixCachingEvictionPolicy = PrefixCachingEvictionPolicy.REF_ZERO
    num_cuda_graphs: int | None = None
    cuda_graph_max_tokens: int = 512
    compile_decode_graphs: bool = False  # extension: torch.compile the forward each decode CUDA graph captures
    kv_cache_management_mode: KVCacheManagementMode = KVCacheManagementMode.PERSIST
    unified_memory_level: int = 0
    use_flashinfer_fused_rope: bool | None = False
    num_speculative_tokens: int = 0
    track_paused_request_events: bool = False
    track_generated_token_events: bool = False
    sampling_backend: Literal["torch", "flashinfer"] = "torch"
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    kv_cache_dtype: Any = None

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "max_sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"InferenceConfig.{name} ({value}) must be a positive int")
        if self.buffer_size_gb <= 0:
            raise ValueError(f"InferenceConfig.buffer_size_gb ({self.buffer_size_gb}) must be > 0")
        for name in ("max_requests", "max_tokens", "num_cuda_graphs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"InferenceConfig.{name} ({value}) must be a positive int or None")
        if self.compile_decode_graphs and self.num_cuda_graphs is None:
            raise ValueError("InferenceConfig.compile_decode_graphs=True compiles the forward that decode CUDA graphs "
                             "capture, so it needs num_cuda_graphs (got None)")
        if self.num_speculative_tokens != 0:
            raise ValueError(
                f"InferenceConfig.num_speculative_tokens ({self.num_speculative_tokens}) must be 0: "
                "speculative decoding is not supported"
            )
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"InferenceConfig.logprobs_mode ({self.logprobs_mode!r}) must be 'raw_logprobs' or 'processed_logprobs'"
            )
        if self.sampling_backend != "torch":
            raise ValueError(f"InferenceConfig.sampling_backend ({self.sampling_backend!r}) must be 'torch'")
        self.prefix_caching_eviction_policy = PrefixCachingEvictionPolicy(self.prefix_caching_eviction_policy)
        self.kv_cache_management_mode = KVCacheManagementMode(self.kv_cache_management_mode)
