"""``OffloadTensorPool``: host buffers for offloaded activations, reused by ``(shape, dtype)``.

Each iteration offloads the same activations, so the buffers of one iteration serve the next: ``reset``
(called by the manager at the end of an iteration) marks every buffer free again, and pinned buffers are
allocated only in the first iteration. Buffers handed back early with ``free`` are reused within the
iteration too.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

__all__ = ["OffloadTensorPool"]


def _contiguous(shape: Any) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class OffloadTensorPool:
    """Buffers on ``device`` (optionally pinned) kept per ``(shape, dtype)``, handed out and taken back."""

    def __init__(self, device: str | torch.device = "cpu", pin_memory: bool = False) -> None:
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        # (shape, dtype) -> {"free": deque of buffers, "all": every buffer made, "allocated_count": in use}
        self._pools: dict[tuple, dict[str, Any]] = {}
        self._stats = dict(total_allocated=0, current_in_use=0, allocation_requests=0, free_requests=0,
                           pool_hits=0, pool_misses=0)

    @staticmethod
    def _key(shape: Any, dtype: torch.dtype, stride: Any = None) -> tuple:
        if stride is None or tuple(stride) == _contiguous(shape):
            return tuple(shape), dtype  # contiguous
        return tuple(shape), dtype, tuple(stride)

    def allocate(self, shape: Any, dtype: torch.dtype = torch.float32, stride: Any = None) -> torch.Tensor:
        """A buffer of ``shape`` and ``dtype`` (and ``stride``, default contiguous): a free one of the pool, else a
        new one (kept by the pool)."""
        self._stats["allocation_requests"] += 1
        key = self._key(shape, dtype, stride)
        pool = self._pools.setdefault(key, {"free": deque(), "all": [], "allocated_count": 0})
        if pool["free"]:
            buffer = pool["free"].popleft()
            self._stats["pool_hits"] += 1
        else:
            buffer = torch.empty_strided(tuple(shape), key[2] if len(key) == 3 else _contiguous(shape), dtype=dtype,
                                         device=self.device, pin_memory=self.pin_memory)
            pool["all"].append(buffer)
            self._stats["total_allocated"] += 1
            self._stats["pool_misses"] += 1
        pool["allocated_count"] += 1
        self._stats["current_in_use"] += 1
        return buffer

    def free(self, tensor: torch.Tensor) -> None:
        """Give ``tensor`` (a buffer this pool handed out) back for reuse."""
        self._stats["free_requests"] += 1
        key = self._key(tensor.shape, tensor.dtype, tensor.stride())
        pool = self._pools.get(key)
        if pool is None:
            raise ValueError(f"OffloadTensorPool.free: no pool for shape={tuple(tensor.shape)}, dtype={tensor.dtype} "
                             f"(pools: {list(self._pools)})")
        if not any(tensor is buffer for buffer in pool["all"]):
            raise ValueError(f"OffloadTensorPool.free: the tensor (shape={tuple(tensor.shape)}, dtype={tensor.dtype}) "
                             "was not allocated by this pool")
        pool["free"].append(tensor)
        pool["allocated_count"] -= 1
        self._stats["current_in_use"] -= 1

    def get_pool_status(self, shape: Any = None, dtype: torch.dtype | None = None, stride: Any = None
                        ) -> dict[str, Any]:
        """Counts of one ``(shape, dtype[, stride])`` pool, or of every pool with the global statistics."""
        if shape is None:
            return {"global_stats": dict(self._stats),
                    "pools": {key: self.get_pool_status(*key) for key in self._pools}}
        if dtype is None:
            raise ValueError("OffloadTensorPool.get_pool_status: dtype must be given with shape")
        pool = self._pools.get(self._key(shape, dtype, stride))
        if pool is None:
            raise ValueError(f"OffloadTensorPool.get_pool_status: no pool for shape={tuple(shape)}, dtype={dtype}")
        total = len(pool["all"])
        return {"shape": tuple(shape), "dtype": dtype, "total_count": total,
                "allocated_count": pool["allocated_count"], "free_count": len(pool["free"]),
                "utilization": pool["allocated_count"] / total * 100 if total else 0}

    def reset(self) -> None:
        """Mark every buffer free (the end of an iteration: the next one reuses them)."""
        for pool in self._pools.values():
            pool["free"] = deque(pool["all"])
            pool["allocated_count"] = 0
        self._stats["current_in_use"] = 0

    def clear(self) -> None:
        """Drop every buffer (their memory returns to the allocator once nothing else holds them)."""
        self._pools.clear()
        self._stats["current_in_use"] = 0
