"""Which KV blocks each request of the dynamic context holds, and how many of its tokens are cached.

Part of :class:`~.dynamic_context.DynamicInferenceContext` (Megatron-Core keeps it in that class): a request
enters with :meth:`RequestBookkeeping.add_request`, grows block by block as the engine schedules its tokens
(:meth:`~RequestBookkeeping.grow_request`), has its cached length advanced after each forward
(:meth:`~RequestBookkeeping.commit_step`) and leaves with :meth:`~RequestBookkeeping.release_request`.
``block_tables_version`` changes whenever any request's block list does (with the rows' request ids it tells
the CUDA-graph inputs when their block tables must be copied again).

With prefix caching a request may enter holding cached blocks of another request's prompt (pinned in the
allocator, counted as already cached tokens), and each of its own prompt blocks is registered under its hash
once all of the block's tokens are computed, so later requests can share it.
"""

from __future__ import annotations

from typing import Any

from megatron_core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron_core.inference.contexts.mamba_states import MambaStateSlots
from megatron_core.inference.contexts.overflow_errors import (
    MaxSequenceLengthOverflowError,
    RequestOverflowError,
)
from megatron_core.inference.contexts.step_entry import StepEntry

__all__ = ["RequestBookkeeping"]


class RequestBookkeeping:
    """The per-request block lists of the dynamic context (a mixin: the context's ``__init__`` sets the state)."""

    block_size_tokens: int
    max_sequence_length: int
    max_requests: int
    enable_prefix_caching: bool
    block_allocator: KVBlockAllocator
    mamba_slots: MambaStateSlots | None
    request_blocks: dict[Any, list[int]]
    block_tables_version: int
    request_kv_length: dict[Any, int]
    request_block_hashes: dict[Any, list[int]]
    _registered_blocks: dict[Any, int]
    step_entries: list[StepEntry]
    step_count: int
    prefix_cache_hits: int
    prefix_cache_blocks_matched: int
    prefix_cache_prefill_skipped_tokens: int

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
            raise MaxSequenceLengthOverflowError(
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

    def rewind_request(self, request_id: Any, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` cached tokens of ``request_id`` (rejected speculative drafts).

        Blocks that then hold none of its tokens are released; their slots are overwritten when it grows again.
        """
        if num_tokens <= 0:
            return
        kv = self.request_kv_length[request_id] - num_tokens
        if kv < 0:
            raise ValueError(f"rewind_request: request {request_id} holds {kv + num_tokens} tokens, cannot drop "
                             f"{num_tokens}")
        self.request_kv_length[request_id] = kv
        blocks = self.request_blocks[request_id]
        keep = self.blocks_for_tokens(kv)
        if len(blocks) > keep:
            crossed = blocks[keep:]
            del blocks[keep:]
            self.block_tables_version += 1
            self.block_allocator.release_memory_blocks(crossed)

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
