"""Rotary embedding at per-token positions (helper of the inference contexts).

``GPTModel`` builds the angles for positions ``0 .. max_sequence_length - 1`` when it runs with an
inference context; a context picks the rows of its tokens' positions, so each request is rotated
at its own offset even when many requests share one flattened step.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.transformer.rope_utils import apply_rotary_pos_emb


def rotate_at_positions(
    query: torch.Tensor, key: torch.Tensor, rotary_pos_emb: Any, positions: torch.Tensor, config: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query``/``key`` ``[s, b, heads, hn]`` by the angles of ``positions`` ``[s]`` or ``[s, b]``."""
    if rotary_pos_emb is None:
        return query, key
    q_emb, k_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb, rotary_pos_emb)
    if positions.dim() == 1:
        q_freqs, k_freqs = q_emb[positions], k_emb[positions]  # [s, 1, 1, d]
    else:  # [s, b] -> [s, b, 1, d]
        q_freqs, k_freqs = q_emb[positions, 0], k_emb[positions, 0]
    return (apply_rotary_pos_emb(query, q_freqs, config=config), apply_rotary_pos_emb(key, k_freqs, config=config))
