"""Multimodal rotary angles (Megatron-Core's ``MultimodalRotaryEmbedding``: Qwen2-VL's "M-RoPE").

Each token has three positions, temporal / height / width (``position_ids`` ``[3, b, s]``; text tokens carry
the same number three times). The rotary frequencies are split into consecutive sections (``mrope_section``,
summing to ``rot_dim / 2``); section ``i`` turns with position component ``i % 3``. The result is the angle
table ``[s, b, 1, rot_dim]`` that ``apply_rotary_pos_emb`` consumes (one row per token and batch entry, since
positions differ between samples), laid out like ``RotaryEmbedding``'s: each angle twice, half-split or
(``rotary_interleaved``) pairwise.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.device import get_current_device
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.rope_utils import get_pos_emb_on_this_cp_rank
from megatron_core.transformer.rotary_pos_embedding import move_inv_freq, rotary_dim, rotary_inv_freq

__all__ = ["MultimodalRotaryEmbedding"]


class MultimodalRotaryEmbedding(torch.nn.Module):
    """Rotary angles from three-component (temporal, height, width) positions; see the module docstring.

    ``inv_freq`` (fp32, ``rot_dim / 2`` values, ``rot_dim = kv_channels * rotary_percent``) is a plain attribute,
    not in the state dict, as in ``RotaryEmbedding``. Under context parallelism (``cp_group`` of size > 1) the
    angles of this rank's two sequence chunks are returned.
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        cp_group: Any = None,
    ) -> None:
        super().__init__()
        dim = rotary_dim(kv_channels, rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        self.inv_freq = rotary_inv_freq(dim, rotary_base, get_current_device())
        self.cp_group = resolve_process_group("cp", group=cp_group)

    def _apply(self, fn: Any, recurse: bool = True) -> MultimodalRotaryEmbedding:
        """Device moves take ``inv_freq`` along; dtype casts leave it fp32 (see ``move_inv_freq``)."""
        super()._apply(fn, recurse)
        move_inv_freq(self, fn)
        return self

    def forward(self, position_ids: torch.Tensor, mrope_section: list[int], cp_group: Any = None) -> torch.Tensor:
        """Angles ``[s, b, 1, rot_dim]`` (fp32) for ``position_ids`` ``[3, b, s]``; ``mrope_section`` sums to
        ``rot_dim / 2``. ``cp_group`` overrides the module's context-parallel group."""
        if position_ids.dim() != 3 or position_ids.shape[0] != 3:
            raise ValueError(f"position_ids must be [3, batch, seq] (temporal, height, width), got "
                             f"{tuple(position_ids.shape)}")
        half = self.inv_freq.numel()
        if sum(mrope_section) != half or any(n < 0 for n in mrope_section):
            raise ValueError(f"mrope_section ({list(mrope_section)}) must be non-negative and sum to rot_dim / 2 "
                             f"({half})")
        positions = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        angles = positions.unsqueeze(-1) * self.inv_freq  # [3, b, s, half]
        component = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
        component = component.to(angles.device).expand(1, *angles.shape[1:])
        chosen = angles.gather(0, component).squeeze(0)  # [b, s, half]: each frequency from its section's component
        if self.rotary_interleaved:
            emb = torch.stack((chosen, chosen), dim=-1).flatten(-2)
        else:
            emb = torch.cat((chosen, chosen), dim=-1)
        emb = emb.transpose(0, 1).unsqueeze(2).contiguous()  # [s, b, 1, rot_dim]
        group = self.cp_group if cp_group is None else cp_group
        if get_pg_size(group) > 1:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb
