"""Packed-sequence ("THD") description passed to attention and RoPE (Megatron-Core's ``PackedSeqParams``).

Several documents are concatenated along the sequence of a ``[1, t]`` micro-batch. ``cu_seqlens_q``
(and ``cu_seqlens_kv``) are the cumulative document lengths ``[0, l0, l0+l1, ..., t]``; the optional
``*_padded`` variants give each document's padded extent (documents padded, e.g. to a multiple of
``2 * context_parallel_size``); tokens are laid out by the padded offsets when those are given.
Each document attends only to itself and RoPE positions restart at every document.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["PackedSeqParams"]


@dataclass
class PackedSeqParams:
    """Document boundaries of a packed micro-batch (``qkv_format="thd"``)."""

    qkv_format: str | None = None
    cu_seqlens_q: Tensor | None = None
    cu_seqlens_kv: Tensor | None = None
    cu_seqlens_q_padded: Tensor | None = None
    cu_seqlens_kv_padded: Tensor | None = None
    max_seqlen_q: int | None = None
    max_seqlen_kv: int | None = None
    local_cp_size: int | None = None
    cp_group: Any = None
    total_tokens: int | None = None
    seq_idx: Tensor | None = None
    tokens_per_sample: int | None = None
    pad_between_seqs: bool | None = None

    def __post_init__(self) -> None:
        """With ``total_tokens`` set, precompute ``seq_idx`` ``[1, total_tokens]`` (document index per token)."""
        cu = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        if isinstance(cu, Tensor) and self.total_tokens is not None and self.seq_idx is None:
            bounds = torch.cat([cu.reshape(-1), cu.new_tensor([self.total_tokens])])
            lengths = (bounds[1:] - bounds[:-1]).clamp(min=0)
            self.seq_idx = torch.repeat_interleave(
                torch.arange(lengths.numel(), device=cu.device), lengths
            ).to(torch.int32).unsqueeze(0)
