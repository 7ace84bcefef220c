"""Inference configuration (Megatron-Core's ``inference.config.InferenceConfig``).

Sizes the dynamic engine: the paged KV cache (``block_size_tokens``, ``buffer_size_gb``), how
many requests and tokens one forward step may hold (``max_requests``, ``max_tokens``), the
longest sequence (``max_sequence_length``), and scheduling features (``enable_chunked_prefill``,
``enable_prefix_caching``, ``async_sched_mode``).
Fields that only matter to Megatron's CUDA kernels (flashinfer, unified memory) are
accepted for signature compatibility and documented as inert in docs/compat.md.
``MambaInferenceStateConfig`` describes a hybrid model's per-request Mamba state caches; set as
``InferenceConfig.mamba_inference_state_config``, it sizes the dynamic context's Mamba state slots
(:mod:`megatron_core.inference.contexts.mamba_states`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

import torch

__all__ = [
    "AsyncScheduleMode",
    "CudaGraphSizingDistribution",
    "InferenceConfig",
    "KVCacheManagementMode",
    "MambaInferenceStateConfig",
    "PrefixCachingCoordinatorPolicy",
    "PrefixCachingEvictionPolicy",
]


@dataclass
class MambaInferenceStateConfig:
    """Shapes and dtypes of a hybrid model's per-request Mamba state caches (Megatron-Core's dataclass).

    ``layer_type_list`` holds one hybrid-pattern symbol per layer (``"M"`` Mamba, ``"*"`` attention, ...);
    ``conv_states_shape`` / ``ssm_states_shape`` are one request's convolution and SSM state shapes on this TP
    rank. The dynamic context keeps one slot of both states per Mamba layer for each request it holds
    (:class:`~megatron_core.inference.contexts.mamba_states.MambaStateSlots`). ``mamba_chunk_size`` is the SSD
    scan chunk of prefill steps (:meth:`from_model` takes the mixers' own); results do not depend on it beyond
    rounding.
    """

    layer_type_list: list[str]
    conv_states_shape: tuple[int, ...]
    ssm_states_shape: tuple[int, ...]
    conv_states_dtype: torch.dtype
    ssm_states_dtype: torch.dtype
    mamba_chunk_size: int = 128

    def __post_init__(self) -> None:
        from megatron_core._ground.hybrid_pattern import Symbols

        name = "MambaInferenceStateConfig"
        layers = self.layer_type_list
        if isinstance(layers, str) or not isinstance(layers, Sequence):
            raise ValueError(f"{name}.layer_type_list ({layers!r}) must be a list of layer symbols, one per layer")
        bad = [symbol for symbol in layers if symbol not in Symbols.VALID_LAYERS]
        if bad:
            raise ValueError(f"{name}.layer_type_list has {bad!r}, which are not layer symbols "
                             f"(valid: {sorted(Symbols.VALID_LAYERS)})")
        for field in ("conv_states_shape", "ssm_states_shape"):
            shape = getattr(self, field)
            if (not isinstance(shape, Sequence) or not shape
                    or any(isinstance(d, bool) or not isinstance(d, int) or d <= 0 for d in shape)):
                raise ValueError(f"{name}.{field} ({shape!r}) must be a non-empty sequence of positive ints")
            setattr(self, field, tuple(shape))
        for field in ("conv_states_dtype", "ssm_states_dtype"):
            dtype = getattr(self, field)
            if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
                raise ValueError(f"{name}.{field} ({dtype!r}) must be a floating-point torch.dtype")
        chunk = self.mamba_chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0:
            raise ValueError(f"{name}.mamba_chunk_size ({chunk!r}) must be a positive int")

    @classmethod
    def from_model(cls, model: Any, conv_states_dtype: torch.dtype | None = None,
                   ssm_states_dtype: torch.dtype | None = None) -> MambaInferenceStateConfig | None:
        """The config of ``model``'s decoder (wrappers unwrapped), or None when it has no Mamba layer.

        Shapes come from the first Mamba layer, the chunk size from its mixer; unset dtypes default to
        ``model.config.params_dtype``.
        """
        from megatron_core._ground.hybrid_pattern import Symbols
        from megatron_core._wrapped_model import get_attr_wrapped_model

        decoder = get_attr_wrapped_model(model, "decoder")
        layer_types = getattr(decoder, "layer_type_list", None)
        if layer_types is None or Symbols.MAMBA not in layer_types:
            return None
        conv_shape, ssm_shape = decoder.mamba_state_shapes_per_request()
        params_dtype = get_attr_wrapped_model(model, "config").params_dtype
        chunk = next((layer.mixer.chunk_size for symbol, layer in zip(layer_types, decoder.layers)
                      if symbol == Symbols.MAMBA and hasattr(layer, "mixer")), 128)
        return cls(layer_type_list=list(layer_types), conv_states_shape=conv_shape, ssm_states_shape=ssm_shape,
                   conv_states_dtype=conv_states_dtype or params_dtype, ssm_states_dtype=ssm_states_dtype or params_dtype,
                   mamba_chunk_size=chunk)


class PrefixCachingEvictionPolicy(str, Enum):
    """What happens to a cached prefix block whose reference count reaches zero."""

    REF_ZERO = "ref_zero"
    LRU = "lru"


class PrefixCachingCoordinatorPolicy(str, Enum):
    """How the data-parallel coordinator routes requests with prefix caching (see ``data_parallel_inference_coordinator.routing``)."""

    LONGEST_PREFIX = "longest_prefix"
    FIRST_PREFIX_BLOCK = "first_prefix_block"
    LOAD_BALANCED = "load_balanced"


class AsyncScheduleMode(str, Enum):
    """When the dynamic engine prepares a step relative to reading the previous step's tokens.

    ``LEGACY``: read the tokens and book them, then schedule and launch the next step. ``ASYNC``: for
    decode steps laid out for CUDA graphs, lay out and launch the next step first and read the previous
    step's tokens while the device runs it (``engines/decode_overlap.py``).
    """

    LEGACY = "legacy"
    ASYNC = "async"


class CudaGraphSizingDistribution(str, Enum):
    """Which padded decode batch sizes get a CUDA graph (``InferenceConfig.cuda_graph_sizing_distribution``).

    ``EXPONENTIAL``: 1, 2, 4, ... below ``max_requests``, then ``max_requests`` (at most 2x padding, few graphs).
    ``LINEAR``: 1, 2, 4, every multiple of 8 below 256, every multiple of 16 from 256, then ``max_requests``
    (little padding at large batches, more graphs to capture).
    """

    EXPONENTIAL = "exponential"
    LINEAR = "linear"


class KVCacheManagementMode(str, Enum):
    """How the KV buffers are treated on suspend / resume."""

    PERSIST = "persist"
    OFFLOAD = "offload"
    RECOMPUTE = "recompute"


@dataclass
class InferenceConfig:
    """Sizes and switches of the dynamic inference engine.

    For a hybrid model, ``mamba_inference_state_config`` (:meth:`MambaInferenceStateConfig.from_model`) gives
    the per-request Mamba states; they are taken from ``buffer_size_gb`` first: ``mamba_memory_ratio`` of it
    (which then caps ``max_requests``), or, when that is None, exactly what ``max_requests`` requests need.

    ``num_speculative_tokens > 0`` turns on speculative decoding with the model's MTP layers (docs/inference.md);
    its rules are checked here (:meth:`_check_speculative`) and the model's in the engine.
    """

    block_size_tokens: int = 256
    buffer_size_gb: float = 20
    paused_buffer_size_gb: float | None = None
    mamba_inference_state_config: MambaInferenceStateConfig | None = None
    mamba_memory_ratio: float | None = None
    max_requests: int | None = None
    max_tokens: int | None = None
    max_sequence_length: int = 2560
    pg_collection: Any = None
    materialize_only_last_token_logits: bool = True
    enable_chunked_prefill: bool = False
    enable_prefix_caching: bool = False
    prefix_caching_eviction_policy: PrefixCachingEvictionPolicy = PrefixCachingEvictionPolicy.REF_ZERO
    prefix_caching_coordinator_policy: PrefixCachingCoordinatorPolicy = PrefixCachingCoordinatorPolicy.LOAD_BALANCED
    prefix_caching_routing_alpha: float = 0.5
    prefix_caching_mamba_gb: float | None = None
    num_cuda_graphs: int | None = None
    cuda_graph_max_tokens: int = 512
    cuda_graph_sizing_distribution: CudaGraphSizingDistribution = CudaGraphSizingDistribution.EXPONENTIAL
    compile_decode_graphs: bool = False  # extension: torch.compile the forward each decode CUDA graph captures
    kv_cache_management_mode: KVCacheManagementMode = KVCacheManagementMode.PERSIST
    unified_memory_level: int = 0
    use_flashinfer_fused_rope: bool | None = False
    num_speculative_tokens: int = 0
    track_paused_request_events: bool = False
    track_generated_token_events: bool = False
    sampling_backend: Literal["torch", "flashinfer"] = "torch"
    async_sched_mode: AsyncScheduleMode = AsyncScheduleMode.LEGACY
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = "raw_logprobs"
    kv_cache_dtype: Any = None

    def __post_init__(self) -> None:
        for name in ("block_size_tokens", "max_sequence_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"InferenceConfig.{name} ({value}) must be a positive int")
        if self.buffer_size_gb <= 0:
            raise ValueError(f"InferenceConfig.buffer_size_gb ({self.buffer_size_gb}) must be > 0")
        mamba = self.mamba_inference_state_config
        if mamba is not None and not isinstance(mamba, MambaInferenceStateConfig):
            raise ValueError(f"InferenceConfig.mamba_inference_state_config must be a MambaInferenceStateConfig or "
                             f"None, got {type(mamba).__name__}")
        if self.prefix_caching_mamba_gb is not None:
            raise ValueError(f"InferenceConfig.prefix_caching_mamba_gb ({self.prefix_caching_mamba_gb}) must be None: "
                             "prefix caching of hybrid models' Mamba states is not supported")
        if self.mamba_memory_ratio is not None and not 0.0 < self.mamba_memory_ratio < 1.0:
            raise ValueError(f"InferenceConfig.mamba_memory_ratio ({self.mamba_memory_ratio}) must be in (0, 1) "
                             "or None")
        for name in ("max_requests", "max_tokens", "num_cuda_graphs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ValueError(f"InferenceConfig.{name} ({value}) must be a positive int or None")
        if self.compile_decode_graphs and self.num_cuda_graphs is None:
            raise ValueError("InferenceConfig.compile_decode_graphs=True compiles the forward that decode CUDA graphs "
                             "capture, so it needs num_cuda_graphs (got None)")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"InferenceConfig.num_speculative_tokens ({k!r}) must be an int >= 0")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(
                f"InferenceConfig.logprobs_mode ({self.logprobs_mode!r}) must be 'raw_logprobs' or 'processed_logprobs'"
            )
        if k > 0:
            self._check_speculative()
        if self.sampling_backend != "torch":
            raise ValueError(f"InferenceConfig.sampling_backend ({self.sampling_backend!r}) must be 'torch'")
        self.prefix_caching_eviction_policy = _enum_field(
            "prefix_caching_eviction_policy", PrefixCachingEvictionPolicy, self.prefix_caching_eviction_policy)
        self.prefix_caching_coordinator_policy = _enum_field(
            "prefix_caching_coordinator_policy", PrefixCachingCoordinatorPolicy, self.prefix_caching_coordinator_policy)
        self.async_sched_mode = _enum_field("async_sched_mode", AsyncScheduleMode, self.async_sched_mode)
        self.cuda_graph_sizing_distribution = _enum_field(
            "cuda_graph_sizing_distribution", CudaGraphSizingDistribution, self.cuda_graph_sizing_distribution)
        if not 0.0 <= self.prefix_caching_routing_alpha <= 1.0:
            raise ValueError(f"InferenceConfig.prefix_caching_routing_alpha ({self.prefix_caching_routing_alpha}) "
                             "must be in [0, 1]")
        self.kv_cache_management_mode = KVCacheManagementMode(self.kv_cache_management_mode)

    def _check_speculative(self) -> None:
        """The rules of speculative decoding with MTP drafts (``num_speculative_tokens > 0``)."""
        k = self.num_speculative_tokens
        if k >= self.block_size_tokens:
            raise ValueError(f"InferenceConfig.num_speculative_tokens ({k}) must be < block_size_tokens "
                             f"({self.block_size_tokens}): a rewind may cross back at most one block")
        if self.logprobs_mode == "processed_logprobs":
            raise ValueError(f"InferenceConfig.logprobs_mode='processed_logprobs' is not supported with speculative "
                             f"decoding (num_speculative_tokens={k}); use 'raw_logprobs'")
        if self.mamba_inference_state_config is not None:
            raise ValueError(f"InferenceConfig.num_speculative_tokens ({k}) needs a GPT model: hybrid models "
                             "(mamba_inference_state_config set) are not supported with speculative decoding")
        if self.max_tokens is not None and self.max_tokens < k + 1:
            raise ValueError(f"InferenceConfig.max_tokens ({self.max_tokens}) must be >= num_speculative_tokens + 1 "
                             f"({k + 1}): one decode step feeds a request's token and its {k} drafts")


def _enum_field(name: str, enum: type[Enum], value: Any) -> Any:
    """``value`` as a member of ``enum``; a ``ValueError`` naming the field and the allowed values otherwise."""
    try:
        return enum(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum)
        raise ValueError(f"InferenceConfig.{name} ({value!r}) must be one of {allowed}") from None
