"""Causal / sliding-window masks of the NeMo audio encoder's attention (``left_context``).

``left_context`` ``None`` or negative: unlimited causal attention; ``n >= 0``: each position sees itself and the
``n`` positions before it. It only makes sense with ``causal_mask=True``.
"""

from __future__ import annotations

import torch


def normalize_left_context(left_context: int | None) -> int | None:
    """``None`` for unlimited left context (``None`` or a negative value), else ``int(left_context)``."""
    if left_context is None or int(left_context) < 0:
        return None
    return int(left_context)


def check_left_context(causal_mask: bool, left_context: int | None) -> int | None:
    """The normalised ``left_context``; ``ValueError`` when one is set without ``causal_mask``."""
    left_context = normalize_left_context(left_context)
    if left_context is not None and not causal_mask:
        raise ValueError(f"left_context ({left_context}) requires causal_mask=True")
    return left_context


def causal_window_size(causal_mask: bool, left_context: int | None) -> tuple[int, int] | None:
    """flash-attention / Transformer Engine ``window_size`` ``(left, 0)`` for a limited left context, else ``None``."""
    left_context = check_left_context(causal_mask, left_context)
    return None if left_context is None else (left_context, 0)


def causal_disallow_mask(query_len: int, key_len: int, left_context: int | None, device: torch.device | None
                         ) -> torch.Tensor:
    """``[query_len, key_len]`` bool, True where a key is hidden from a query (queries are the last positions)."""
    queries = torch.arange(key_len - query_len, key_len, device=device)[:, None]
    keys = torch.arange(key_len, device=device)[None, :]
    hidden = keys > queries
    left_context = normalize_left_context(left_context)
    if left_context is not None:
        hidden = hidden | (keys < queries - left_context)
    return hidden
