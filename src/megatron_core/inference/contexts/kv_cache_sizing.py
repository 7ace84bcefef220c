"""How many KV blocks and requests the dynamic context holds (the sizing in Megatron-Core's
``DynamicInferenceContext.__init__``).

One block is ``block_size_tokens`` token slots of key and value in every attention layer of this rank, for the
KV heads of this tensor-parallel rank: ``2 * layers * block_size_tokens * kv_heads * head_dim * dtype bytes``.
The block count is ``buffer_size_gb`` over that, after a hybrid model's Mamba state slots are taken out of the
buffer (:func:`~.mamba_states.reserve_mamba_memory`), capped at what ``max_requests`` sequences of
``max_sequence_length`` tokens can use. Every refusal names the config fields behind it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts.mamba_states import (
    MambaStateSlots,
    check_hybrid_inference_config,
    count_attention_layers,
    reserve_mamba_memory,
)

__all__ = ["DEFAULT_MAX_REQUESTS", "DEFAULT_MAX_TOKENS", "KVCacheSizing", "kv_cache_head_shape", "size_kv_cache",
           "tp_pp_sizes"]

DEFAULT_MAX_TOKENS = 16384
DEFAULT_MAX_REQUESTS = 256


def tp_pp_sizes(pg_collection: Any) -> tuple[int, int]:
    """Tensor- and pipeline-parallel sizes from ``pg_collection`` or ``parallel_state``."""
    import torch.distributed as dist

    from megatron_core import parallel_state

    tp = pp = 1
    if pg_collection is not None:
        tp_group, pp_group = getattr(pg_collection, "tp", None), getattr(pg_collection, "pp", None)
        tp = dist.get_world_size(tp_group) if tp_group is not None else 1
        pp = dist.get_world_size(pp_group) if pp_group is not None else 1
    elif parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
    return tp, pp


def kv_cache_head_shape(model_config: Any, tp: int) -> tuple[int, int]:
    """``(KV heads on this TP rank, head width)`` of the cached keys and values of one layer.

    Grouped-query attention caches ``num_query_groups`` heads of ``kv_channels``. Multi-latent attention caches
    every attention head's key and value, padded to one width: ``qk_head_dim + qk_pos_emb_head_dim`` or
    ``v_head_dim``, whichever is wider (``MultiLatentAttention._pad``).
    """
    if getattr(model_config, "multi_latent_attention", False):
        qk = model_config.qk_head_dim + model_config.qk_pos_emb_head_dim
        return max(1, model_config.num_attention_heads // tp), max(qk, model_config.v_head_dim)
    groups = model_config.num_query_groups or model_config.num_attention_heads
    head_dim = model_config.kv_channels or model_config.hidden_size // model_config.num_attention_heads
    return max(1, groups // tp), head_dim


@dataclass(frozen=True)
class KVCacheSizing:
    """The dynamic context's capacity: KV cache geometry, step and request limits, and a hybrid model's Mamba slots."""

    num_layers_local: int
    num_groups_local: int
    head_dim: int
    bytes_per_block: int
    max_tokens: int
    max_requests: int
    total_blocks: int
    mamba_slots: MambaStateSlots | None


def size_kv_cache(model_config: Any, inference_config: InferenceConfig) -> KVCacheSizing:
    """Size the cache of ``inference_config`` for ``model_config`` on this rank; ``ValueError`` if no block fits."""
    tp, pp = tp_pp_sizes(inference_config.pg_collection)
    mamba_config = inference_config.mamba_inference_state_config
    is_hybrid = mamba_config is not None
    if is_hybrid:
        check_hybrid_inference_config(inference_config)
        # Only the attention layers have a KV cache (at least one layer is sized, so the engine's block
        # bookkeeping works for a model without attention too).
        num_layers = max(1, count_attention_layers(mamba_config))
    else:
        num_layers = max(1, model_config.num_layers // pp)
    groups, head_dim = kv_cache_head_shape(model_config, tp)
    block_size = inference_config.block_size_tokens
    dtype = inference_config.kv_cache_dtype or getattr(model_config, "params_dtype", torch.float32)
    bytes_per_block = 2 * num_layers * block_size * groups * head_dim * torch.empty((), dtype=dtype).element_size()
    max_tokens = inference_config.max_tokens or DEFAULT_MAX_TOKENS
    max_requests = min(inference_config.max_requests or DEFAULT_MAX_REQUESTS, max_tokens)
    kv_bytes = inference_config.buffer_size_gb * 1024**3
    mamba_slots = None
    if is_hybrid:
        kv_bytes, max_requests = reserve_mamba_memory(inference_config, kv_bytes, max_requests)
        mamba_slots = MambaStateSlots(mamba_config, max_requests)
    total_blocks = int(kv_bytes // bytes_per_block)
    if total_blocks < 1:
        raise ValueError(
            f"InferenceConfig.buffer_size_gb ({inference_config.buffer_size_gb}) holds no KV block of "
            f"{bytes_per_block} bytes (block_size_tokens={block_size}, "
            f"{num_layers} layers, {groups} KV heads of {head_dim})"
            + (" after the Mamba states" if is_hybrid else "")
        )
    # Never more blocks than max_requests full-length sequences can use.
    blocks_per_sequence = -(-inference_config.max_sequence_length // block_size)
    total_blocks = min(total_blocks, max_requests * blocks_per_sequence)
    return KVCacheSizing(num_layers, groups, head_dim, bytes_per_block, max_tokens, max_requests, total_blocks,
                         mamba_slots)
