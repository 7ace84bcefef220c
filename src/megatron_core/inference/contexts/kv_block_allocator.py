"""Fixed-size KV-cache block allocator (Megatron-Core's ``contexts.kv_block_allocator.KVBlockAllocator``).

The paged KV cache is ``total_count`` blocks of ``block_size_tokens`` token slots per layer. The
allocator hands out block ids from a free stack and takes them back; it never hands out more
than it has (``allocate_memory_blocks`` returns ``None`` instead), so an overflow is always
visible to the caller, which then pauses or evicts requests.

With prefix caching, a block whose prompt tokens are complete is *registered* under the hash of
its prompt prefix (:func:`~megatron_core.inference.inference_request.compute_block_hashes_batched`)
and can be shared: every holder counts in its reference count, and a new request whose prompt
starts with the same blocks *pins* them instead of computing them again. When the count returns
to zero the eviction policy decides: ``REF_ZERO`` forgets the hash and frees the block at once;
``LRU`` keeps it cached (reusable by a later request with the same prefix) until an allocation
needs room, which evicts the least recently released cached blocks first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["KVBlockAllocator"]


class KVBlockAllocator:
    """A free list of block ids ``0 .. total_count - 1``, with optional shared (prefix-cached) blocks."""

    def __init__(self, total_count: int, enable_prefix_caching: bool = False,
                 prefix_caching_eviction_policy: str = "ref_zero") -> None:
        if total_count < 1:
            raise ValueError(f"KVBlockAllocator: total_count ({total_count}) must be >= 1")
        policy = str(getattr(prefix_caching_eviction_policy, "value", prefix_caching_eviction_policy))
        if policy not in ("ref_zero", "lru"):
            raise ValueError(f"KVBlockAllocator: prefix_caching_eviction_policy must be 'ref_zero' or 'lru', "
                             f"got {prefix_caching_eviction_policy!r}")
        self.total_count = total_count
        self.enable_prefix_caching = enable_prefix_caching
        self.keeps_released_blocks = enable_prefix_caching and policy == "lru"
        self.reset()

    def reset(self) -> None:
        """Mark every block free and forget every cached prefix."""
        self._free: list[int] = list(range(self.total_count - 1, -1, -1))
        self._ref_count: dict[int, int] = {}  # blocks held by requests -> number of holders
        self.kv_hash_to_block_id: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU: released registered blocks, oldest first

    def __str__(self) -> str:
        return (f"KVBlockAllocator(used={len(self._ref_count)}/{self.total_count}, "
                f"cached={len(self._cached)})")

    def get_total_used(self) -> int:
        """Blocks held by at least one request."""
        return len(self._ref_count)

    def get_cached_count(self) -> int:
        """Blocks no request holds that keep a cached prefix (``LRU`` policy); evictable."""
        return len(self._cached)

    def get_active_avail(self) -> int:
        """Blocks an allocation can have now: free ones plus evictable cached ones."""
        return len(self._free) + len(self._cached)

    total_avail = property(get_active_avail)

    def is_memory_available(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` can be allocated now."""
        return num_blocks <= self.get_active_avail()

    def allocate_memory_blocks(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` block ids, or ``None`` (nothing allocated) if not enough are available.

        Cached blocks are evicted (their prefixes forgotten), least recently released first, only when
        the free blocks do not suffice.
        """
        if num_blocks < 0:
            raise ValueError(f"allocate_memory_blocks: num_blocks ({num_blocks}) must be >= 0")
        if num_blocks > self.get_active_avail():
            return None
        while len(self._free) < num_blocks:
            block, _ = self._cached.popitem(last=False)
            self._forget(block)
            self._free.append(block)
        blocks = [self._free.pop() for _ in range(num_blocks)]
        for block in blocks:
            self._ref_count[block] = 1
        return blocks

    def release_memory_blocks(self, blocks: Sequence[int]) -> None:
        """Drop one holder of each block; a block nobody holds is freed (or, ``LRU``, kept cached).

        Releasing a block that no request holds is an error.
        """
        for block in blocks:
            count = self._ref_count.get(block)
            if count is None:
                raise ValueError(f"release_memory_blocks: block {block} is not allocated")
            if count > 1:
                self._ref_count[block] = count - 1
                continue
            del self._ref_count[block]
            if self.keeps_released_blocks and block in self._hash_of_block:
                self._cached[block] = None
            else:
                self._forget(block)
                self._free.append(block)

    # ---- prefix caching -------------------------------------------------------------------------------

    def register_kv_block_hashes(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """Make complete prompt blocks findable by the hash of their prefix.

        A hash that another block already serves keeps that block (two requests that prefilled the same
        prefix at the same time each keep their own copy; only the first is shared).
        """
        if not self.enable_prefix_caching:
            return
        for block, block_hash in zip(block_ids, block_hashes):
            if block_hash in self.kv_hash_to_block_id or block in self._hash_of_block:
                continue
            if block not in self._ref_count:
                raise ValueError(f"register_kv_block_hashes: block {block} is not allocated")
            self.kv_hash_to_block_id[block_hash] = block
            self._hash_of_block[block] = block_hash

    def match_prefix(self, block_hashes: Sequence[int]) -> list[int]:
        """The cached blocks of the longest run of ``block_hashes`` from the start (nothing is pinned)."""
        matched = []
        for block_hash in block_hashes:
            block = self.kv_hash_to_block_id.get(block_hash)
            if block is None:
                break
            matched.append(block)
        return matched

    def count_evictable(self, block_ids: Sequence[int]) -> int:
        """How many of ``block_ids`` are cached without a holder (pinning them takes them out of the evictable pool)."""
        return sum(1 for block in block_ids if block in self._cached)

    def pin(self, block_ids: Sequence[int]) -> None:
        """Add a holder to each of ``block_ids`` (blocks found by :meth:`match_prefix`)."""
        for block in block_ids:
            if block in self._ref_count:
                self._ref_count[block] += 1
            elif block in self._cached:
                del self._cached[block]
                self._ref_count[block] = 1
            else:
                raise ValueError(f"pin: block {block} is neither held nor cached")

    def ref_count(self, block: int) -> int:
        """Number of requests holding ``block``."""
        return self._ref_count.get(block, 0)

    def _forget(self, block: int) -> None:
        block_hash = self._hash_of_block.pop(block, None)
        if block_hash is not None and self.kv_hash_to_block_id.get(block_hash) == block:
            del self.kv_hash_to_block_id[block_hash]
