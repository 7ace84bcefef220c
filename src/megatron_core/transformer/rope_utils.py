"""Rotary position embedding math (Megatron-Core's ``apply_rotary_pos_emb``).

``freqs`` is ``[s, 1, 1, rot_dim]`` as produced by ``RotaryEmbedding``: the angles for each
position, laid out as ``[f0..f_{d/2-1}, f0..f_{d/2-1}]`` (half-split, as in Hugging Face Llama)
or, with ``rotary_interleaved``, ``[f0, f0, f1, f1, ...]`` (pairs of adjacent channels rotate
together, as in GPT-J). Only the first ``rot_dim`` channels rotate (``rotary_percent < 1``);
the rest pass through.
"""

from __future__ import annotations

from typing import Any

import torch


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, config: object = None, cu_seqlens: torch.Tensor | None = None,
    rotary_interleaved: bool | None = None, mscale: float = 1.0, cp_group: Any = None,
) -> torch.Tensor:
    """Rotate ``t`` ``[s, b, heads, dim]`` by the angles ``freqs`` ``[s, 1, 1, rot_dim]``.

    ``rotary_interleaved`` defaults to ``config.rotary_interleaved``. With ``cu_seqlens`` (a packed
    sequence, padded offsets) each token uses its position inside its document; ``freqs`` must
    then cover the longest document (not CP-split), and under context parallelism ``cp_group``
    says which per-document chunks this rank holds.
    """
    if rotary_interleaved is None:
        rotary_interleaved = bool(getattr(config, "rotary_interleaved", False))
    rot_dim = freqs.shape[-1]
    seq_len = t.shape[0]
    if cu_seqlens is not None:
        from megatron_core.transformer.packed_sequences import thd_positions_from_cu

        cp_size = cp_group.size() if cp_group is not None else 1
        cp_rank = cp_group.rank() if cp_group is not None else 0
        freqs = freqs[thd_positions_from_cu(cu_seqlens, seq_len, cp_size, cp_rank, freqs.device)]
    else:
        freqs = freqs[:seq_len]
    cos = (torch.cos(freqs) * mscale).to(t.dtype)
    sin = (torch.sin(freqs) * mscale).to(t.dtype)
    if rot_dim == t.shape[-1]:
        return t * cos + _rotate_half(t, rotary_interleaved) * sin
    t_rot, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t_rot = t_rot * cos + _rotate_half(t_rot, rotary_interleaved) * sin
    return torch.cat((t_rot, t_pass), dim=-1)
