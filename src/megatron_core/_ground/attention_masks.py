"""Boolean attention masks in Megatron's convention (``True`` = the query must not see that key).

Megatron-Core defines these in ``transformer.utils``; they live on the ground floor so that the softmax in
``fusions`` (below ``transformer``) builds its default masks with the same rule. ``transformer.utils``
re-exports them.
"""

from __future__ import annotations

import torch

from megatron_core import device as _device

__all__ = ["get_default_causal_mask", "get_sliding_window_causal_mask"]


def get_default_causal_mask(sq: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[sq, sq]`` bool mask, True above the diagonal (the positions a causal query must not see)."""
    device = device or _device.get_current_device()
    return torch.triu(torch.ones(sq, sq, device=device), diagonal=1).bool()


def get_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int],
                                   device: torch.device | str | None = None) -> torch.Tensor:
    """``[sq, skv]`` bool mask, True outside the window ``(left, right)`` around each query's diagonal."""
    device = device or _device.get_current_device()
    allowed = torch.ones(sq, skv, dtype=torch.bool, device=device)
    allowed = torch.triu(allowed, diagonal=skv - sq - window_size[0])
    allowed = torch.tril(allowed, diagonal=skv - sq + window_size[1])
    return ~allowed
