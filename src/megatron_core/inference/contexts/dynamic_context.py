"""The paged KV cache of the dynamic engine (Megatron-Core's ``contexts.dynamic_context.DynamicInferenceContext``).

Memory: per layer, one key and one value buffer of ``total_block_count`` blocks of
``block_size_tokens`` token slots (``[blocks * block_size, groups, head_dim]``, allocated on first
use with the key's dtype and device). The block count is ``buffer_size_gb`` over the bytes one
block takes across this rank's layers, capped at what ``max_requests`` sequences of
``max_sequence_length`` tokens can use. A :class:`KVBlockAllocator` hands blocks to requests; each
request has a block table (its block ids in order), so token ``p`` of a request lives in slot
``table[p // block_size] * block_size + p % block_size``.

One step: the engine picks, per request, the tokens to feed (one for a decoding request, a prompt
or a chunk of it for a prefilling one) and calls :meth:`initialize_attention_state`. All tokens
of the step are flattened into one sequence ``[1, T]`` (decode tokens first) with each token's own
position. In every layer, :meth:`attention` rotates query and key at those positions, writes the
keys and values into their slots and attends: the decode tokens with the paged kernel of
:mod:`.paged_attention` on CUDA (reading blocks in place), elsewhere in one batched SDPA over their
gathered block tables (padded, masked); each prefill chunk with a causal SDPA over its request's
cached prefix. Growing a request that needs a block when none is free fails loudly
(``BlockOverflowError`` / ``False`` from :meth:`grow_request`); the engine then pauses or evicts.

With ``enable_prefix_caching``, :meth:`add_request` takes the request's prompt-block hashes: the
cached blocks of the longest matching prefix are shared (pinned in the allocator) and count as
already cached tokens; :meth:`commit_step` registers each prompt block once its tokens are computed.

For a hybrid model (``InferenceConfig.mamba_inference_state_config``), ``mamba_slots`` (:mod:`.mamba_states`)
gives each request a slot of Mamba convolution and SSM state per Mamba layer, taken in :meth:`add_request`
and freed in :meth:`release_request`; :meth:`mamba_states_cache` and :meth:`mamba_step_layout` are what the
Mamba mixers read in a step (in a padded CUDA-graph decode step, a fixed-address slot index per graph batch size
whose padding rows name a scratch slot). Only the attention layers get KV buffers.

With the model's ``moe_enable_routing_replay``, ``moe_routing_metadata`` (:mod:`.routing_metadata`) keeps
the experts each fed token was routed to, per KV slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts.base_context import BaseInferenceContext
from megatron_core.inference.contexts.decode_graph_inputs import DecodeGraphInputs, graph_batch_sizes
from megatron_core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_core.inference.contexts.mamba_states import (
    MambaStateSlots,
    check_hybrid_inference_config,
    count_attention_layers,
    reserve_mamba_memory,
)
from megatron_core.inference.contexts.paged_attention import paged_decode_attention, paged_decode_supported
from megatron_core.inference.contexts.rope_cache_append import rope_cache_append, rope_cache_append_supported
from megatron_core.inference.contexts.rotary import rotate_at_positions
from megatron_core.inference.contexts.routing_metadata import RoutingMetadata

__all__ = [
    "ContextOverflowError",
    "RequestOverflowError",
    "TokenOverflowError",
    "BlockOverflowError",
    "StepEntry",
    "DynamicInferenceContext",
    "get_mem_size_str",
]

DEFAULT_MAX_TOKENS = 16384
DEFAULT_MAX_REQUESTS = 256

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


class ContextOverflowError(Exception):
    """A request does not fit in the context."""

    def __init__(self, request_id: Any, message: str | None = None, *, is_transient: bool = True) -> None:
        super().__init__(f"request {'--' if request_id is None else request_id}" + (f" | {message}" if message else ""))
        self.request_id = request_id
        self.message = message
        self.is_transient = is_transient


class RequestOverflowError(ContextOverflowError):
    """Adding the request would exceed ``max_requests``."""


class TokenOverflowError(ContextOverflowError):
    """The request is longer than ``max_sequence_length`` or than one step's ``max_tokens``."""

    def __init__(self, request_id: Any, message: str | None = None) -> None:
        super().__init__(request_id, message, is_transient=False)


class BlockOverflowError(ContextOverflowError):
    """Not enough free KV blocks."""


@dataclass
class StepEntry:
    """The tokens one request feeds in a step.

    ``start`` is the position of ``tokens[0]`` (= the number of the request's tokens already in the
    cache). ``sample``: the chunk reaches the end of the sequence, so a next token is sampled from
    its last logits row. ``all_logits``: materialize logits for every token (prompt log-probs);
    ``next_token`` is then the token after the chunk when the chunk does not end the sequence.
    The context fills ``logit_rows`` (the rows of this entry in the step's logits).
    """

    request_id: Any
    tokens: list[int]
    start: int
    sample: bool = True
    all_logits: bool = False
    next_token: int | None = None
    logit_rows: list[int] = field(default_factory=list)


def _tp_pp_sizes(pg_collection: Any) -> tuple[int, int]:
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


def _kv_cache_head_shape(model_config: Any, tp: int) -> tuple[int, int]:
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


class DynamicInferenceContext(BaseInferenceContext):
    """Paged KV cache and the layout of one continuous-batching step."""

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
        tp, pp = _tp_pp_sizes(inference_config.pg_collection)
        mamba_config = inference_config.mamba_inference_state_config
        self.is_hybrid_model = mamba_config is not None
        if self.is_hybrid_model:
            check_hybrid_inference_config(inference_config)
            # Only the attention layers have a KV cache (at least one layer is sized, so the engine's block
            # bookkeeping works for a model without attention too).
            self.num_layers_local = max(1, count_attention_layers(mamba_config))
        else:
            self.num_layers_local = max(1, model_config.num_layers // pp)
        self.num_groups_local, self.head_dim = _kv_cache_head_shape(model_config, tp)
        dtype = inference_config.kv_cache_dtype or getattr(model_config, "params_dtype", torch.float32)
        self.bytes_per_block = (
            2 * self.num_layers_local * self.block_size_tokens * self.num_groups_local * self.head_dim
            * torch.empty((), dtype=dtype).element_size()
        )
        self.max_tokens = inference_config.max_tokens or DEFAULT_MAX_TOKENS
        self.max_requests = min(inference_config.max_requests or DEFAULT_MAX_REQUESTS, self.max_tokens)
        kv_bytes = inference_config.buffer_size_gb * 1024**3
        self.mamba_slots: MambaStateSlots | None = None
        if self.is_hybrid_model:
            kv_bytes, self.max_requests = reserve_mamba_memory(inference_config, kv_bytes, self.max_requests)
            self.mamba_slots = MambaStateSlots(mamba_config, self.max_requests)
        total_blocks = int(kv_bytes // self.bytes_per_block)
        if total_blocks < 1:
            raise ValueError(
                f"InferenceConfig.buffer_size_gb ({inference_config.buffer_size_gb}) holds no KV block of "
                f"{self.bytes_per_block} bytes (block_size_tokens={self.block_size_tokens}, "
                f"{self.num_layers_local} layers, {self.num_groups_local} KV heads of {self.head_dim})"
                + (" after the Mamba states" if self.is_hybrid_model else "")
            )
        # Never more blocks than max_requests full-length sequences can use.
        total_blocks = min(total_blocks, self.max_requests * self.blocks_for_tokens(self.max_sequence_length))
        self.block_allocator = KVBlockAllocator(total_blocks, self.enable_prefix_caching,
                                                self.prefix_caching_eviction_policy)
        # One extra block past the allocator's range: padding rows of CUDA-graph decode steps write there.
        self.scratch_block = total_blocks
        self.use_cuda_graphs = inference_config.num_cuda_graphs is not None
        self.graph_sizes = (graph_batch_sizes(self.max_requests, inference_config.cuda_graph_sizing_distribution.value)
                            if self.use_cuda_graphs else [])
        self.graph_inputs: dict[int, DecodeGraphInputs] = {}
        self.graph_batch_size: int | None = None
        self.pad_decode_steps_on_cpu = False  # lay out graph-style padded decode steps on CPU too (tests)
        self.device: torch.device | None = None
        self.kv_memory: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.request_blocks: dict[Any, list[int]] = {}
        self.block_tables_version = 0  # bumped whenever any request's block list changes
        self.request_kv_length: dict[Any, int] = {}
        # Prefix caching: each request's prompt-block hashes, and how many of its blocks are registered.
        self.request_block_hashes: dict[Any, list[int]] = {}
        self._registered_blocks: dict[Any, int] = {}
        self.step_entries: list[StepEntry] = []
        self.step_count = 0
        # Rollout routing replay: the routing of every token fed (see .routing_metadata).
        self.moe_enable_routing_replay = bool(getattr(model_config, "moe_enable_routing_replay", False))
        self.moe_routing_metadata: RoutingMetadata | None = None
        if self.moe_enable_routing_replay:
            if not getattr(model_config, "num_moe_experts", None):
                raise ValueError("moe_enable_routing_replay records MoE routing, but the model has no "
                                 "num_moe_experts")
            self.moe_routing_metadata = RoutingMetadata(self, model_config.moe_router_topk,
                                                        model_config.num_moe_experts)

    # ---- capacity ---------------------------------------------------------------------------------

    @property
    def total_block_count(self) -> int:
        """Blocks in the cache."""
        return self.block_allocator.total_count

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens of one request."""
        return -(-num_tokens // self.block_size_tokens)

    @property
    def total_request_count(self) -> int:
        """Requests holding KV blocks (running or paused)."""
        return len(self.request_blocks)

    def is_static_batching(self) -> bool:
        """Always ``False``."""
        return False

    def is_decode_only(self) -> bool:
        """Whether every request of the current step feeds exactly one token."""
        return all(len(e.tokens) == 1 for e in self.step_entries)

    # ---- per-request KV blocks --------------------------------------------------------------------

    def add_request(self, request_id: Any, block_hashes: list[int] | None = None,
                    matched_blocks: list[int] = ()) -> int:
        """Register a request; returns how many of its first tokens are already cached.

        With prefix caching, ``block_hashes`` are its prompt's (:func:`compute_block_hashes_batched`):
        its own prompt blocks are registered under them as they complete. ``matched_blocks``, from
        :meth:`matched_prefix_blocks`, are cached blocks holding its first tokens: they are shared
        (pinned) instead of computed.
        """
        if request_id in self.request_blocks:
            raise ValueError(f"DynamicInferenceContext: request {request_id} is already in the context")
        if len(self.request_blocks) >= self.max_requests:
            raise RequestOverflowError(request_id, f"max_requests ({self.max_requests}) reached")
        matched = list(matched_blocks)
        if self.mamba_slots is not None:
            self.mamba_slots.allocate(request_id)
        self.block_allocator.pin(matched)
        self.request_blocks[request_id] = matched
        self.block_tables_version += 1
        cached = len(matched) * self.block_size_tokens
        self.request_kv_length[request_id] = cached
        if self.enable_prefix_caching and block_hashes:
            self.request_block_hashes[request_id] = list(block_hashes)
            self._registered_blocks[request_id] = len(matched)
        if matched:
            self.prefix_cache_hits += 1
            self.prefix_cache_blocks_matched += len(matched)
            self.prefix_cache_prefill_skipped_tokens += cached
        return cached

    def matched_prefix_blocks(self, block_hashes: list[int] | None, max_cached_tokens: int) -> list[int]:
        """The cached blocks a request with these prompt-block hashes would share (nothing is pinned)."""
        if not self.enable_prefix_caching or not block_hashes:
            return []
        return self.block_allocator.match_prefix(block_hashes[: max_cached_tokens // self.block_size_tokens])

    def has_request(self, request_id: Any) -> bool:
        """Whether ``request_id`` holds a place in the cache."""
        return request_id in self.request_blocks

    def kv_length(self, request_id: Any) -> int:
        """Tokens of ``request_id`` already in the cache."""
        return self.request_kv_length[request_id]

    def blocks_to_grow(self, request_id: Any, total_tokens: int) -> int:
        """Extra blocks ``request_id`` needs to hold ``total_tokens`` tokens."""
        return max(0, self.blocks_for_tokens(total_tokens) - len(self.request_blocks[request_id]))

    def grow_request(self, request_id: Any, total_tokens: int) -> bool:
        """Give ``request_id`` blocks for ``total_tokens`` tokens; ``False`` (nothing allocated) if too few are free."""
        if total_tokens > self.max_sequence_length:
            raise TokenOverflowError(
                request_id, f"{total_tokens} tokens exceed max_sequence_length ({self.max_sequence_length})"
            )
        need = self.blocks_to_grow(request_id, total_tokens)
        if need == 0:
            return True
        blocks = self.block_allocator.allocate_memory_blocks(need)
        if blocks is None:
            return False
        self.request_blocks[request_id].extend(blocks)
        self.block_tables_version += 1
        return True

    def release_request(self, request_id: Any) -> None:
        """Free the request's blocks and forget it (finished, cancelled or evicted)."""
        blocks = self.request_blocks.pop(request_id, None)
        self.block_tables_version += 1
        if self.mamba_slots is not None:
            self.mamba_slots.release(request_id)
        self.request_kv_length.pop(request_id, None)
        self.request_block_hashes.pop(request_id, None)
        self._registered_blocks.pop(request_id, None)
        if blocks:
            self.block_allocator.release_memory_blocks(blocks)

    def reset(self) -> None:
        """Forget every request and free every block (the buffers are kept)."""
        self.request_blocks.clear()
        self.block_tables_version += 1
        self.request_kv_length.clear()
        self.request_block_hashes.clear()
        self._registered_blocks.clear()
        self.block_allocator.reset()
        if self.mamba_slots is not None:
            self.mamba_slots.reset()
        self.step_entries = []

    # ---- one step ---------------------------------------------------------------------------------

    def initialize_attention_state(
        self, entries: list[StepEntry], device_tokens: torch.Tensor | None = None,
        device_token_rows: list[int] | None = None,
    ) -> None:
        """Lay out one step: decode entries first, then prefill chunks; build positions, slots and tables.

        With ``device_tokens``, every entry is a decode entry whose token is not known on the host
        yet: entry ``i`` reads row ``device_token_rows[i]`` of that device tensor (the previous step's
        samples), gathered on the device without waiting for it.
        """
        if not entries:
            raise ValueError("initialize_attention_state: a step needs at least one entry")
        if device_tokens is not None and (device_token_rows is None or len(device_token_rows) != len(entries)
                                          or any(len(e.tokens) != 1 for e in entries)):
            raise ValueError("initialize_attention_state: device_tokens needs one row per entry, all decode entries")
        device = self.device or torch.device("cpu")
        decode = [e for e in entries if len(e.tokens) == 1]
        prefill = [e for e in entries if len(e.tokens) > 1]
        padded = device.type == "cuda" or self.pad_decode_steps_on_cpu
        if (self.use_cuda_graphs and padded and not prefill and len(decode) <= min(self.graph_sizes[-1], self.max_tokens)
                and all(e.sample and not e.all_logits for e in decode)):
            self._decode_graph_step(decode, device, device_tokens, device_token_rows)
            return
        self.step_entries = decode + prefill
        total = sum(len(e.tokens) for e in self.step_entries)
        if total > self.max_tokens:
            raise TokenOverflowError(None, f"step of {total} tokens exceeds max_tokens ({self.max_tokens})")
        bs = self.block_size_tokens
        ids, positions, slots, logit_index = [], [], [], []
        self._prefill_segments: list[tuple[int, int, int, torch.Tensor | None]] = []
        offset = 0
        for entry in self.step_entries:
            blocks = self.request_blocks[entry.request_id]
            if self.request_kv_length[entry.request_id] != entry.start:
                raise ValueError(
                    f"request {entry.request_id}: step starts at position {entry.start} but the cache holds "
                    f"{self.request_kv_length[entry.request_id]} tokens"
                )
            n = len(entry.tokens)
            end = entry.start + n
            if len(blocks) * bs < end:
                raise BlockOverflowError(entry.request_id, f"holds {len(blocks)} blocks, needs {self.blocks_for_tokens(end)}")
            ids.extend(entry.tokens)
            pos = range(entry.start, end)
            positions.extend(pos)
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            if entry.all_logits or not self.materialize_only_last_token_logits:
                rows = list(range(offset, offset + n))
            elif entry.sample:
                rows = [offset + n - 1]
            else:
                rows = []
            entry.logit_rows = list(range(len(logit_index), len(logit_index) + len(rows)))
            logit_index.extend(rows)
            if n > 1:
                table = None if entry.start == 0 else torch.tensor(blocks[: self.blocks_for_tokens(end)], device=device)
                self._prefill_segments.append((offset, n, end, table))
            offset += n
        self.num_decode = len(decode)
        self.graph_batch_size = None
        if self.mamba_slots is not None:
            slot = self.mamba_slots.slot
            self._mamba_decode_slots = torch.tensor([slot(e.request_id) for e in decode], dtype=torch.long,
                                                    device=device)
            self._mamba_prefill = [(first, n, slot(e.request_id))
                                   for (first, n, _, _), e in zip(self._prefill_segments, prefill)]
        padded = device.type == "cuda" or self.pad_decode_steps_on_cpu
        if self.use_cuda_graphs and not prefill and padded and self._all_last_rows(logit_index, total):
            self._graph_layout(decode, ids, positions, slots, device, None, device_tokens, device_token_rows)
            return
        self.input_ids = torch.tensor(ids, dtype=torch.long, device=device).unsqueeze(0)
        if device_tokens is not None:
            self.input_ids[0] = device_tokens[torch.tensor(device_token_rows, device=device_tokens.device)]
        self.position_ids = torch.tensor(positions, dtype=torch.long, device=device).unsqueeze(0)
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        self.logit_index = torch.tensor(logit_index, dtype=torch.long, device=device)
        self._all_rows = len(logit_index) == total
        if decode:
            lengths = [e.start + 1 for e in decode]
            width = max(self.blocks_for_tokens(n) for n in lengths)
            table = [self.request_blocks[e.request_id][:width] for e in decode]
            table = [t + [0] * (width - len(t)) for t in table]
            self._decode_tables = torch.tensor(table, dtype=torch.long, device=device)
            kv_len = self._decode_kv_len = torch.tensor(lengths, device=device)
            keep = torch.arange(width * bs, device=device)[None, :] < kv_len[:, None]
            self._decode_mask = keep[:, None, None, :]

    def _decode_graph_step(self, decode: list[StepEntry], device: torch.device, device_tokens: torch.Tensor | None,
                           device_token_rows: list[int] | None) -> None:
        """The layout of a decode-only step that a CUDA graph runs (the common step: kept to plain lists)."""
        self.step_entries = decode
        self._prefill_segments = []
        bs = self.block_size_tokens
        kv_lengths, request_blocks = self.request_kv_length, self.request_blocks
        ids, positions, slots, tables = [], [], [], []
        for row, entry in enumerate(decode):
            blocks = request_blocks[entry.request_id]
            position = entry.start
            if kv_lengths[entry.request_id] != position:
                raise ValueError(f"request {entry.request_id}: step starts at position {position} but the cache "
                                 f"holds {kv_lengths[entry.request_id]} tokens")
            if len(blocks) * bs <= position:
                raise BlockOverflowError(entry.request_id, f"holds {len(blocks)} blocks, needs "
                                         f"{self.blocks_for_tokens(position + 1)}")
            ids.append(entry.tokens[0])
            positions.append(position)
            slots.append(blocks[position // bs] * bs + position % bs)
            tables.append(blocks)
            entry.logit_rows = [row]
        self.num_decode = len(decode)
        self._graph_layout(decode, ids, positions, slots, device, tables, device_tokens, device_token_rows)

    @staticmethod
    def _all_last_rows(logit_index: list[int], total: int) -> bool:
        return len(logit_index) == total

    def _graph_layout(self, decode: list[StepEntry], ids: list[int], positions: list[int], slots: list[int],
                      device: torch.device, tables: list[list[int]] | None = None,
                      device_tokens: torch.Tensor | None = None, device_token_rows: list[int] | None = None) -> None:
        """Decode-only step into the static tensors of the smallest graph batch size that fits."""
        batch = next(b for b in self.graph_sizes if b >= len(decode))
        inputs = self.graph_inputs.get(batch)
        if inputs is None:
            width = self.blocks_for_tokens(self.max_sequence_length)
            inputs = self.graph_inputs[batch] = DecodeGraphInputs(
                batch, width, self.block_size_tokens, self.scratch_block, device
            )
        if tables is None:
            tables = [self.request_blocks[e.request_id] for e in decode]
        inputs.fill(ids, positions, slots, tables,
                    tables_key=(self.block_tables_version, tuple(e.request_id for e in decode)),
                    source_rows=device_token_rows)
        if device_tokens is not None:
            inputs.take_tokens(device_tokens)
        self.graph_batch_size = self.num_decode = batch
        self.input_ids, self.position_ids, self.slot_mapping = inputs.input_ids, inputs.position_ids, inputs.slot_mapping
        self._decode_tables, self._decode_mask, self._decode_kv_len = inputs.tables, inputs.mask, inputs.kv_len
        self._prefill_segments = []
        self._all_rows = True
        if self.mamba_slots is not None:
            self._mamba_decode_slots = self.mamba_slots.graph_slots(batch, [e.request_id for e in decode], device)
            self._mamba_prefill = []

    def current_input_and_position_ids(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions of the step, ``[1, T]`` each."""
        return self.input_ids, self.position_ids

    def commit_step(self) -> None:
        """After the forward: the step's tokens are now cached (and, with prefix caching, completed prompt blocks shareable)."""
        kv_lengths, pending = self.request_kv_length, self._registered_blocks
        for entry in self.step_entries:
            kv = kv_lengths[entry.request_id] = entry.start + len(entry.tokens)
            if pending and entry.request_id in pending:
                self._register_complete_blocks(entry.request_id, kv)
        self.step_count += 1

    def _register_complete_blocks(self, request_id: Any, kv_length: int) -> None:
        hashes = self.request_block_hashes[request_id]
        done = self._registered_blocks[request_id]
        complete = min(kv_length // self.block_size_tokens, len(hashes))
        if complete > done:
            self.block_allocator.register_kv_block_hashes(self.request_blocks[request_id][done:complete],
                                                          hashes[done:complete])
        if complete >= len(hashes):
            del self._registered_blocks[request_id]  # every prompt block is registered: nothing more to check
        else:
            self._registered_blocks[request_id] = max(done, complete)

    def select_logit_hidden_states(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Only the rows whose logits the step needs: ``[T, 1, h]`` -> ``[L, 1, h]``."""
        if self._all_rows:
            return hidden_states
        return hidden_states.index_select(0, self.logit_index)

    # ---- Mamba states (hybrid models) -------------------------------------------------------------

    def mamba_states_cache(self, layer_number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(conv states, ssm states)`` of Mamba layer ``layer_number``, one row per slot (see :mod:`.mamba_states`)."""
        if self.mamba_slots is None:
            raise ValueError("a Mamba layer ran under a DynamicInferenceContext built without "
                             "InferenceConfig.mamba_inference_state_config; set it from "
                             "MambaInferenceStateConfig.from_model(model) to serve a hybrid model")
        return self.mamba_slots.states(layer_number, self.device or torch.device("cpu"))

    def snapshot_decode_states(self) -> Callable[[], None] | None:
        """Save the Mamba states of this decode step's slots; returns the function that restores them (None for
        a model without Mamba layers). The CUDA-graph warm-up runs a step more than once: see ``DecodeGraphRunner``."""
        if self.mamba_slots is None:
            return None
        return self.mamba_slots.snapshot(self._mamba_decode_slots)

    def mamba_step_layout(self) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """The Mamba slots of the step: the decode rows' slots ``[num_decode]`` and, per prefill chunk,
        ``(first row, rows, slot)``."""
        return self._mamba_decode_slots, self._mamba_prefill

    # ---- attention --------------------------------------------------------------------------------

    def _layer_memory(self, layer: int, groups: int, head_dim: int, like: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
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
        return out.view(total, 1, np_ * hn)
