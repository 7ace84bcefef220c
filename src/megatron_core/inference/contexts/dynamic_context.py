"""The paged KV cache of the dynamic engine (Megatron-Core's ``contexts.dynamic_context.DynamicInferenceContext``).

Memory: per layer, one key and one value buffer of ``total_block_count`` blocks of
``block_size_tokens`` token slots (``[blocks * block_size, groups, head_dim]``, allocated on first
use with the key's dtype and device). The block count is ``buffer_size_gb`` over the bytes one
block takes across this rank's layers, capped at what ``max_requests`` sequences of
``max_sequence_length`` tokens can use (:mod:`.kv_cache_sizing`). A :class:`KVBlockAllocator` hands
blocks to requests; each request has a block table (its block ids in order), so token ``p`` of a
request lives in slot ``table[p // block_size] * block_size + p % block_size``.

One step: the engine picks, per request, the tokens to feed (one for a decoding request, a prompt
or a chunk of it for a prefilling one) and calls :meth:`initialize_attention_state`
(:mod:`.step_layout`). All tokens of the step are flattened into one sequence ``[1, T]`` (decode
tokens first) with each token's own position. In every layer, :meth:`attention` (this module)
rotates query and key at those positions, writes the keys and values into their slots and attends:
the decode tokens with the paged kernel of :mod:`.paged_attention` on CUDA (reading blocks in
place), elsewhere in one batched SDPA over their gathered block tables (padded, masked); each
prefill chunk with a causal SDPA over its request's cached prefix. Growing a request that needs a
block when none is free fails loudly (``BlockOverflowError`` / ``False`` from :meth:`grow_request`,
:mod:`.request_bookkeeping`); the engine then pauses or evicts.

With ``enable_prefix_caching``, :meth:`add_request` takes the request's prompt-block hashes: the
cached blocks of the longest matching prefix are shared (pinned in the allocator) and count as
already cached tokens; :meth:`commit_step` registers each prompt block once its tokens are computed.

For a hybrid model (``InferenceConfig.mamba_inference_state_config``), ``mamba_slots``
(:mod:`.mamba_states`) gives each request a slot of Mamba convolution and SSM state per Mamba layer,
taken in :meth:`add_request` and freed in :meth:`release_request`; :meth:`mamba_states_cache` and
:meth:`mamba_step_layout` (:mod:`.mamba_step_slots`) are what the Mamba mixers read in a step (in a
padded CUDA-graph decode step, a fixed-address slot index per graph batch size whose padding rows
name a scratch slot). Only the attention layers get KV buffers.

While the engine is suspended the KV buffers and Mamba states are deallocated, offloaded to the host or kept,
per ``InferenceConfig.kv_cache_management_mode`` (:meth:`deallocate_inference_state_buffers` /
:meth:`reinitialize_inference_state_buffers`, :mod:`.buffer_offload`); meanwhile a call that would touch them
raises ``TensorStateDeallocatedError`` naming the call.

With the model's ``moe_enable_routing_replay``, ``moe_routing_metadata`` (:mod:`.routing_metadata`) keeps
the experts each fed token was routed to, per KV slot.

A sequence-parallel model under tensor parallelism gets steps padded to a multiple of the TP size (see
:mod:`.step_layout`; ``step_token_multiple``); the padding rows write the scratch block and attend to nothing.

With ``num_speculative_tokens > 0`` a decoding request's entry also carries its MTP drafts (every fed token gets a
logits row, ``StepEntry.draft_tokens``), the model leaves the logit rows' hidden states in
``mtp_decoder_hidden_states`` for drafting, and :meth:`rewind_request` drops rejected drafts from the cache
(releasing blocks crossed back); such steps never use the decode CUDA-graph layout.

The errors (:mod:`.overflow_errors`) and :class:`StepEntry` (:mod:`.step_entry`) are importable from
here, Megatron-Core's module for them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground.decorators import deprecate_args
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.buffer_offload import InferenceStateBuffers
from megatron_core.inference.contexts.decode_graph_inputs import DecodeGraphInputs, graph_batch_sizes
from megatron_core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_core.inference.contexts.kv_cache_sizing import DEFAULT_MAX_REQUESTS as DEFAULT_MAX_REQUESTS
from megatron_core.inference.contexts.kv_cache_sizing import DEFAULT_MAX_TOKENS as DEFAULT_MAX_TOKENS
from megatron_core.inference.contexts.kv_cache_sizing import size_kv_cache
from megatron_core.inference.contexts.mamba_states import MambaStateSlots
from megatron_core.inference.contexts.overflow_errors import (
    ActiveRequestCountOverflowError,
    BlockOverflowError,
    ContextErrorFactory,
    ContextOverflowError,
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
    TensorStateDeallocatedError,
    TokenOverflowError,
)
from megatron_core.inference.contexts.paged_attention import paged_decode_attention, paged_decode_supported
from megatron_core.inference.contexts.rope_cache_append import rope_cache_append, rope_cache_append_supported
from megatron_core.inference.contexts.rotary import rotate_at_positions
from megatron_core.inference.contexts.routing_metadata import RoutingMetadata
from megatron_core.inference.contexts.step_entry import StepEntry
from megatron_core.inference.contexts.step_layout import StepLayout, step_token_multiple

__all__ = [
    "ActiveRequestCountOverflowError",
    "ContextErrorFactory",
    "ContextOverflowError",
    "MaxSequenceLengthOverflowError",
    "RequestOverflowError",
    "TensorStateDeallocatedError",
    "TokenOverflowError",
    "BlockOverflowError",
    "StepEntry",
    "DynamicInferenceContext",
    "get_mem_size_str",
    "DEPRECATED_ARGS",
]

DEPRECATED_ARGS = [
    "params_dtype", "num_layers", "kv_channels", "num_attention_heads", "max_sequence_length", "buffer_size_gb",
    "paused_buffer_size_gb", "max_requests", "max_tokens", "block_size_tokens", "tensor_model_parallel_size",
    "pipeline_model_parallel_size", "pg_collection", "cache_mla_latent", "kv_lora_rank", "qk_pos_emb_head_dim",
    "num_cuda_graphs", "materialize_only_last_token_logits", "mamba_inference_state_config",
    "use_cuda_graphs_for_non_decode_steps", "use_flashinfer_fused_rope", "unified_memory_level",
    "cuda_graph_max_tokens", "cuda_graph_mixed_prefill_count", "metrics_writer", "request_metadata_types",
    "persist_cuda_graphs", "offload_kv_cache",
]
"""Former ``DynamicInferenceContext`` keyword arguments (now read from the model config or ``InferenceConfig``);
passing one raises ``TypeError``."""

_MEM_UNITS = (("TB", 1024**4), ("GB", 1024**3), ("MB", 1024**2), ("KB", 1024), ("bytes", 1))


def get_mem_size_str(n_bytes: int) -> str:
    """A byte count for logs, with three significant digits: ``"1.5 GB"``, ``"0.75 MB"``, ``"12 bytes"``.

    The unit is the largest of TB, GB, MB, KB (powers of 1024) of which the count is more than
    half (so 768 KiB reads ``"0.75 MB"``); ``0`` is ``"0 bytes"``. Negative counts raise ``ValueError``.
    """
    if n_bytes < 0:
        raise ValueError(f"get_mem_size_str: n_bytes must be >= 0, got {n_bytes}")
    if n_bytes == 0:
        return "0 bytes"
    for suffix, unit in _MEM_UNITS:
        if round(n_bytes / unit) >= 1:
            return f"{n_bytes / unit:.3g} {suffix}"
    return f"{n_bytes:.3g} bytes"


class DynamicInferenceContext(InferenceStateBuffers, StepLayout, BaseInferenceContext):
    """Paged KV cache and the layout of one continuous-batching step."""

    @deprecate_args(*DEPRECATED_ARGS,
                    message="Argument `{name}` has been deprecated. Only pass `model_config` and `inference_config`")
    def __init__(self, model_config: Any, inference_config: InferenceConfig) -> None:
        super().__init__(inference_config.materialize_only_last_token_logits)
        self.inference_config = inference_config
        self.block_size_tokens = inference_config.block_size_tokens
        self.max_sequence_length = inference_config.max_sequence_length
        self.enable_chunked_prefill = inference_config.enable_chunked_prefill
        self.enable_prefix_caching = inference_config.enable_prefix_caching
        self.prefix_caching_eviction_policy = inference_config.prefix_caching_eviction_policy
        # Prefix-cache statistics (Megatron's names): requests that matched, blocks matched, prompt tokens skipped.
        self.prefix_cache_hits = 0
        self.prefix_cache_blocks_matched = 0
        self.prefix_cache_prefill_skipped_tokens = 0
        self.is_hybrid_model = inference_config.mamba_inference_state_config is not None
        sizing = size_kv_cache(model_config, inference_config)
        self.num_layers_local, self.num_groups_local, self.head_dim = (
            sizing.num_layers_local, sizing.num_groups_local, sizing.head_dim)
        self.bytes_per_block = sizing.bytes_per_block
        self.max_tokens, self.max_requests = sizing.max_tokens, sizing.max_requests
        self.mamba_slots: MambaStateSlots | None = sizing.mamba_slots
        total_blocks = sizing.total_blocks
        self.block_allocator = KVBlockAllocator(total_blocks, self.enable_prefix_caching,
                                                self.prefix_caching_eviction_policy)
        # One extra block past the allocator's range: padding rows of CUDA-graph decode steps write there.
        self.scratch_block = total_blocks
        # Speculative steps feed several tokens per decoding request: they run eagerly (no decode CUDA graphs).
        self.use_cuda_graphs = (inference_config.num_cuda_graphs is not None
                                and inference_config.num_speculative_tokens == 0)
        # Sequence parallelism splits each step's tokens evenly over the TP ranks: steps are padded to a multiple.
        self.step_token_multiple = step_token_multiple(model_config)
        self.graph_sizes = (graph_batch_sizes(self.max_requests, inference_config.cuda_graph_sizing_distribution.value,
                                              self.step_token_multiple)
                            if self.use_cuda_graphs else [])
        self.graph_inputs: dict[int, DecodeGraphInputs] = {}
        self.graph_batch_size: int | None = None
        self.pad_decode_steps_on_cpu = False  # lay out graph-style padded decode steps on CPU too (tests)
        self.device: torch.device | None = None
        self.kv_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._init_state_buffers(inference_config.kv_cache_management_mode)
        self.request_blocks: dict[Any, list[int]] = {}
        self.block_tables_version = 0  # bumped whenever any request's block list changes
        self.request_kv_length: dict[Any, int] = {}
        # Prefix caching: each request's prompt-block hashes, and how many of its blocks are registered.
        self.request_block_hashes: dict[Any, list[int]] = {}
        self._registered_blocks: dict[Any, int] = {}
        self.step_entries: list[StepEntry] = []
        self.step_count = 0
        # Speculative decoding: drafts per decode step; the model leaves its logit rows' hidden states here.
        self.num_speculative_tokens = inference_config.num_speculative_tokens
        self.keep_mtp_hidden_states = self.num_speculative_tokens > 0
        self.mtp_decoder_hidden_states: torch.Tensor | None = None
        # Rollout routing replay: the routing of every token fed (see .routing_metadata).
        self.moe_enable_routing_replay = bool(getattr(model_config, "moe_enable_routing_replay", False))
        self.moe_routing_metadata: RoutingMetadata | None = None
        if self.moe_enable_routing_replay:
            if not getattr(model_config, "num_moe_experts", None):
                raise ValueError("moe_enable_routing_replay records MoE routing, but the model has no "
                                 "num_moe_experts")
            self.moe_routing_metadata = RoutingMetadata(self, model_config.moe_router_topk,
                                                        model_config.num_moe_experts)

    def is_static_batching(self) -> bool:
        """Always ``False``."""
        return False

    def add_request(self, request_id: Any, block_hashes: list[int] | None = None,
                    matched_blocks: list[int] = ()) -> int:
        """See :meth:`RequestBookkeeping.add_request`; refused while the tensor state is deallocated."""
        self.check_tensor_state_allocated("add_request", request_id)
        return super().add_request(request_id, block_hashes, matched_blocks)

    def initialize_attention_state(self, entries: list[StepEntry], device_tokens: torch.Tensor | None = None,
                                   device_token_rows: list[int] | None = None) -> None:
        """See :meth:`StepLayout.initialize_attention_state`; refused while the tensor state is deallocated."""
        self.check_tensor_state_allocated("initialize_attention_state")
        super().initialize_attention_state(entries, device_tokens, device_token_rows)

    def mamba_states_cache(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`MambaStepSlots.mamba_states_cache`; refused while the tensor state is deallocated."""
        self.check_tensor_state_allocated("mamba_states_cache")
        return super().mamba_states_cache(layer_number)

    def _layer_memory(self, layer: int, groups: int, head_dim: int, like: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_tensor_state_allocated("attention")
        memory = self.kv_memory.get(layer)
        if memory is None:
            shape = ((self.total_block_count + 1) * self.block_size_tokens, groups, head_dim)
            memory = self.kv_memory[layer] = (
                torch.zeros(shape, dtype=like.dtype, device=like.device),
                torch.zeros(shape, dtype=like.dtype, device=like.device),
            )
        return memory

    def attention_from_qkv(self, attention: Any, mixed_qkv: torch.Tensor, rotary_pos_emb: Any) -> torch.Tensor:
        """:meth:`attention` from ``linear_qkv``'s output ``[T, 1, ...]``.

        In a decode-only step on CUDA the rotation and both cache writes are one kernel
        (:func:`~megatron_core.inference.contexts.rope_cache_append.rope_cache_append`), which reads the
        fused projection in place; otherwise the projection is split and :meth:`attention` runs.
        """
        total = mixed_qkv.shape[0]
        if (self.num_decode == total and attention.q_layernorm is None and attention.k_layernorm is None
                and isinstance(rotary_pos_emb, torch.Tensor)):
            groups, head_dim = attention.num_query_groups_per_partition, attention.hidden_size_per_attention_head
            k_mem, v_mem = self._layer_memory(attention.layer_number, groups, head_dim, mixed_qkv)
            if rope_cache_append_supported(mixed_qkv, rotary_pos_emb, k_mem):
                self.check_attention_supported(attention)
                heads = groups * attention.heads_per_group
                interleaved = bool(getattr(attention.config, "rotary_interleaved", False))
                query = rope_cache_append(mixed_qkv, rotary_pos_emb, self.position_ids[0], self.slot_mapping, k_mem,
                                          v_mem, heads, interleaved)
                return self._attend(attention, query.view(total, 1, heads, head_dim), None, None, k_mem, v_mem)
        return super().attention_from_qkv(attention, mixed_qkv, rotary_pos_emb)

    def attention(
        self, attention: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rotary_pos_emb: Any,
    ) -> torch.Tensor:
        """Rotate, cache and attend for the flattened step: ``query`` ``[T, 1, np, hn]`` -> ``[T, 1, np*hn]``."""
        self.check_attention_supported(attention)
        query, key = rotate_at_positions(query, key, rotary_pos_emb, self.position_ids[0], attention.config)
        k_mem, v_mem = self._layer_memory(attention.layer_number, key.shape[-2], key.shape[-1], key)
        k_mem.index_copy_(0, self.slot_mapping, key[:, 0])
        v_mem.index_copy_(0, self.slot_mapping, value[:, 0])
        return self._attend(attention, query, key, value, k_mem, v_mem)

    def _attend(self, attention: Any, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
                k_mem: torch.Tensor, v_mem: torch.Tensor) -> torch.Tensor:
        """Attention of the step's rotated ``query`` ``[T, 1, np, hn]`` over the caches (keys and values of this
        step already written); ``key``/``value`` are needed only by fresh prompts (``None`` in a decode-only step)."""
        total, _, np_, hn = query.shape
        ng = k_mem.shape[1]
        gqa = ng != np_
        scale = getattr(getattr(attention, "core_attention", None), "softmax_scale", None)
        nd, bs = self.num_decode, self.block_size_tokens
        paged = nd and paged_decode_supported(query, k_mem)
        if paged:
            # Read the blocks where they lie (no per-step copy of the cache); see paged_attention.
            decoded = paged_decode_attention(query[:nd, 0], k_mem, v_mem, self._decode_tables, self._decode_kv_len,
                                             bs, scale)
            if nd == total:  # decode only: the kernel's output is the result
                return decoded.view(total, 1, np_ * hn)
        out = query.new_empty(total, np_, hn)
        if paged:
            out[:nd] = decoded
        elif nd:
            width = self._decode_tables.shape[1]
            k = k_mem.view(-1, bs, ng, hn)[self._decode_tables].view(nd, width * bs, ng, hn).transpose(1, 2)
            v = v_mem.view(-1, bs, ng, hn)[self._decode_tables].view(nd, width * bs, ng, hn).transpose(1, 2)
            # The query heads of one KV group share its keys and mask: put them on the query axis
            # ([nd, groups, heads_per_group, hn]) so SDPA needs no GQA expansion of the cache.
            q = query[:nd, 0].view(nd, ng, np_ // ng, hn)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=self._decode_mask, scale=scale)
            out[:nd] = o.reshape(nd, np_, hn)
        for q0, n, kv_len, table in self._prefill_segments:
            if table is None:  # a fresh prompt: its keys are exactly this chunk's
                k, v = key[q0 : q0 + n, 0], value[q0 : q0 + n, 0]
            else:
                k = k_mem.view(-1, bs, ng, hn)[table].view(-1, ng, hn)[:kv_len]
                v = v_mem.view(-1, bs, ng, hn)[table].view(-1, ng, hn)[:kv_len]
            q = query[q0 : q0 + n, 0].transpose(0, 1).unsqueeze(0)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            if kv_len == n:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            else:
                keep = torch.ones(n, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=kv_len - n)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=gqa)
            out[q0 : q0 + n] = o[0].transpose(0, 1)
        if self.sequence_padding_start < total:  # a sequence-parallel step's padding rows
            out[self.sequence_padding_start:] = 0
        return out.view(total, 1, np_ * hn)
