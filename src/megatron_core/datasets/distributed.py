"""The few collectives the dataset builders use: rank queries and the build barrier.

Megatron builds dataset indices on rank 0 first, then lets the other ranks load the cached files
after a barrier. Everything here degrades to a single process when ``torch.distributed`` is not
initialised.
"""

from __future__ import annotations

import torch


def is_initialized() -> bool:
    """True when a default process group exists."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def get_rank() -> int:
    """Global rank, or 0 without a process group."""
    return torch.distributed.get_rank() if is_initialized() else 0


def barrier() -> None:
    """Wait for every rank of the default group (no-op without a process group)."""
    if is_initialized():
        torch.distributed.barrier()
