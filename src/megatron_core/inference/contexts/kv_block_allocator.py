"""Fixed-size KV-cache block allocator (Megatron-Core's ``contexts.kv_block_allocator.KVBlockAllocator``).

The paged KV cache is ``total_count`` blocks of ``block_size_tokens`` token slots per layer. The
allocator hands out block ids from a free stack and takes them back; it never hands out more
than it has (``allocate_memory_blocks`` returns ``None`` instead), so an overflow is always
visible to the caller, which then pauses or evicts requests.
"""

from __future__ import annotations

__all__ = ["KVBlockAllocator"]


class KVBlockAllocator:
    """A free list of block ids ``0 .. total_count - 1``."""

    def __init__(self, total_count: int) -> None:
        if total_count < 1:
            raise ValueError(f"KVBlockAllocator: total_count ({total_count}) must be >= 1")
        self.total_count = total_count
        self.reset()

    def reset(self) -> None:
        """Mark every block free."""
        self._free: list[int] = list(range(self.total_count - 1, -1, -1))
        self._used: set[int] = set()

    def __str__(self) -> str:
        return f"KVBlockAllocator(used={len(self._used)}/{self.total_count})"

    def get_total_used(self) -> int:
        """Blocks currently handed out."""
        return len(self._used)

    def get_active_avail(self) -> int:
        """Blocks free to allocate."""
        return len(self._free)

    total_avail = property(get_active_avail)

    def is_memory_available(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` can be allocated now."""
        return num_blocks <= len(self._free)

    def allocate_memory_blocks(self, num_blocks: int) -> list[int] | None:
        """``num_blocks`` block ids, or ``None`` (nothing allocated) if not enough are free."""
        if num_blocks < 0:
            raise ValueError(f"allocate_memory_blocks: num_blocks ({num_blocks}) must be >= 0")
        if num_blocks > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(num_blocks)]
        self._used.update(blocks)
        return blocks

    def release_memory_blocks(self, blocks: list[int]) -> None:
        """Return blocks to the free list; releasing a block that is not in use is an error."""
        for block in blocks:
            if block not in self._used:
                raise ValueError(f"release_memory_blocks: block {block} is not allocated")
            self._used.remove(block)
            self._free.append(block)
