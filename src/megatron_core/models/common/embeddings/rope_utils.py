"""Rotary position embedding functions with Megatron-Core 0.19's signatures (``models.common.embeddings.rope_utils``).

The rotation is :mod:`megatron_core.transformer.rope_utils`'s (one function each way, with a hand-written
backward); this module keeps Megatron-Core's calling conventions on top of it:

* :func:`apply_rotary_pos_emb` takes ``mscale`` (default 1: the caller passes YaRN's factor) and
  ``mla_rotary_interleaved``; packed input is ``[tokens, heads, dim]``, with angles either for the longest
  document (each document restarts at position 0) or for every packed token (``freqs`` has
  ``cu_seqlens[-1]`` rows: token ``i`` of the packed batch uses row ``i``). ``config.apply_rope_fusion`` picks
  no other kernel: the values are the same.
* :func:`apply_rotary_pos_emb_with_cos_sin` rotates by given cosines and sines (flash decoding's form).
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.mla_rope import deinterleave_rope_channels
from megatron_core.transformer.packed_sequences import thd_layout_from_cu, thd_partitioned_indices
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb as _rotate_by_angles
from megatron_core.transformer.rope_utils import get_pos_emb_on_this_cp_rank, rotate

__all__ = ["apply_rotary_pos_emb", "apply_rotary_pos_emb_with_cos_sin", "get_pos_emb_on_this_cp_rank"]


def apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    config: Any,
    cu_seqlens: torch.Tensor | None = None,
    mscale: float = 1.0,
    cp_group: Any = None,
    mla_rotary_interleaved: bool | None = False,
) -> torch.Tensor:
    """Rotate ``t`` by the angles ``freqs`` (``RotaryEmbedding``'s output), cosines and sines scaled by ``mscale``.

    ``t`` is ``[s, b, heads, dim]``, or ``[tokens, heads, dim]`` with ``cu_seqlens`` (packed documents; under
    context parallelism, this rank's chunks of each). ``config.rotary_interleaved`` picks the channel layout.
    ``mla_rotary_interleaved`` (None: ``config.multi_latent_attention``) first reorders the rotated channels
    from pairs to halves, as multi-latent attention stores them. ``cp_group`` defaults to ``parallel_state``'s.
    """
    if cp_group is None:
        cp_group = resolve_process_group("cp")
    if mla_rotary_interleaved is None:
        mla_rotary_interleaved = bool(getattr(config, "multi_latent_attention", False))
    if mla_rotary_interleaved:
        t = deinterleave_rope_channels(t, freqs.shape[-1])
    interleaved = bool(getattr(config, "rotary_interleaved", False))
    if cu_seqlens is None:
        return _rotate_by_angles(t, freqs, config, rotary_interleaved=interleaved, mscale=mscale)
    if t.dim() != 3:
        raise ValueError(f"packed input (cu_seqlens given) must be [tokens, heads, dim], got {tuple(t.shape)}")
    total = int(cu_seqlens[-1])
    if freqs.shape[0] == total:
        # One angle row per packed token: keep the rows of the tokens this CP rank holds.
        cp_size, cp_rank = (cp_group.size(), cp_group.rank()) if cp_group is not None else (1, 0)
        layout = thd_layout_from_cu(cu_seqlens, total)
        rows = torch.tensor(thd_partitioned_indices(layout, cp_size, cp_rank), device=freqs.device)
        return _rotate_by_angles(t.unsqueeze(1), freqs[rows], config, rotary_interleaved=interleaved,
                                 mscale=mscale).squeeze(1)
    return _rotate_by_angles(t.unsqueeze(1), freqs, config, cu_seqlens=cu_seqlens, rotary_interleaved=interleaved,
                             mscale=mscale, cp_group=cp_group).squeeze(1)


def apply_rotary_pos_emb_with_cos_sin(
    t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_interleaved: bool = False
) -> torch.Tensor:
    """Rotate ``t`` ``[s, b, heads, dim]`` by the angles whose cosines and sines are ``cos`` / ``sin`` ``[s, rot/2]``.

    The first ``rot`` channels of each head rotate (as halves, or as adjacent pairs with ``rotary_interleaved``);
    the rest pass through. The tables are cast to ``t``'s dtype first.
    """
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != t.shape[0]:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [s, rot/2] with s = "
                         f"t.shape[0] ({t.shape[0]})")
    tables = []
    for table in (cos.to(t.dtype), sin.to(t.dtype)):
        full = table.repeat_interleave(2, dim=-1) if rotary_interleaved else torch.cat((table, table), dim=-1)
        tables.append(full.reshape(full.shape[0], *([1] * (t.dim() - 2)), full.shape[-1]))
    return rotate(t, tables[0], tables[1], rotary_interleaved)
