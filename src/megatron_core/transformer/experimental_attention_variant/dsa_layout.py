"""Where DeepSeek sparse attention's tokens sit under context parallelism and packed sequences (Megatron-Core's
``dsa_layout``, the PyTorch-path helpers).

DSA's context parallelism is all-gather: each CP rank keeps its own queries and attends to the keys of the whole
sequence, gathered from every rank. The ranks hold Megatron's load-balanced ("zigzag") split: a sequence of ``S``
tokens is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``; a packed ("THD")
micro-batch is split that way per document (documents padded to multiples of ``2 * cp``,
:mod:`megatron_core.transformer.packed_sequences`). The gathered keys arrive in rank order; a permutation puts
them back in sequence order, so key ``j`` is the sequence's token ``j``.

:func:`dsa_token_layout` gives, for this rank's query rows, their index in the whole (packed) sequence and the
first key each may see (its document's start; 0 without packing), plus that key permutation; the causal mask of a
query is then ``doc_start <= key <= position``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices

__all__ = [
    "DSATokenLayout",
    "build_zigzag_allgather_cp_key_reorder",
    "build_zigzag_cp_local_positions",
    "dsa_token_layout",
    "ensure_sbhd",
    "get_packed_qk_cu_seqlens",
]


def ensure_sbhd(tensor: torch.Tensor, name: str) -> tuple[torch.Tensor, bool]:
    """``(tensor as [s, b, h, d], whether it came packed as [t, h, d])``."""
    if tensor.ndim == 4:
        return tensor, False
    if tensor.ndim == 3:
        return tensor.unsqueeze(1), True
    raise ValueError(f"{name} must be [t, h, d] (packed) or [s, b, h, d], got {tensor.ndim} dimensions")


def build_zigzag_cp_local_positions(seq_len: int, cp_size: int, cp_rank: int, device: Any = None) -> torch.Tensor:
    """The sequence positions (int64) CP rank ``cp_rank`` holds of a ``seq_len``-token sequence: chunks ``cp_rank``
    and ``2 * cp_size - 1 - cp_rank`` of ``2 * cp_size``."""
    if cp_size <= 1:
        return torch.arange(seq_len, dtype=torch.int64, device=device)
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length ({seq_len}) must be divisible by 2 * context_parallel_size "
                         f"({2 * cp_size}) for the load-balanced CP split")
    c = seq_len // (2 * cp_size)
    back = 2 * cp_size - 1 - cp_rank
    return torch.cat((torch.arange(cp_rank * c, (cp_rank + 1) * c, dtype=torch.int64, device=device),
                      torch.arange(back * c, (back + 1) * c, dtype=torch.int64, device=device)))


def build_zigzag_allgather_cp_key_reorder(sq: int, cp_size: int, device: Any = None) -> torch.Tensor:
    """The permutation that puts keys all-gathered over CP (``sq`` rows per rank, rank order) in sequence order."""
    total = sq * cp_size
    gathered = torch.cat([build_zigzag_cp_local_positions(total, cp_size, r, device) for r in range(cp_size)])
    return torch.argsort(gathered)


def get_packed_qk_cu_seqlens(packed_seq_params: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens_q, cu_seqlens_kv)`` of packed sequences, the padded ones where given; either defaults to the
    other."""
    cu_q = packed_seq_params.cu_seqlens_q_padded
    cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
    cu_kv = packed_seq_params.cu_seqlens_kv_padded
    cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
    if cu_q is None and cu_kv is None:
        raise ValueError("PackedSeqParams needs cu_seqlens_q or cu_seqlens_kv for DSA's packed-sequence masking")
    return (cu_kv if cu_q is None else cu_q), (cu_q if cu_kv is None else cu_kv)


@dataclass(frozen=True)
class DSATokenLayout:
    """This rank's query rows in the whole sequence and the gathered keys' order (see the module docstring).

    ``query_positions`` ``[sq]``: each query row's index in the whole (packed) sequence; ``doc_starts`` ``[sq]``:
    the index of the first key it may see; ``key_reorder`` ``[cp * sq]`` or None (no CP): keys gathered in rank
    order, indexed by it, are in sequence order.
    """

    query_positions: torch.Tensor
    doc_starts: torch.Tensor
    key_reorder: torch.Tensor | None

    def causal_mask(self, sk: int) -> torch.Tensor:
        """The additive float32 mask ``[sq, sk]``: 0 where ``doc_start <= key <= position``, ``-inf`` elsewhere."""
        keys = torch.arange(sk, dtype=torch.int64, device=self.query_positions.device)
        valid = (keys >= self.doc_starts.unsqueeze(-1)) & (keys <= self.query_positions.unsqueeze(-1))
        mask = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
        return mask.masked_fill_(~valid, float("-inf"))


_LAYOUTS: dict[tuple, DSATokenLayout] = {}


def _packed_layout(packed_seq_params: Any, sq: int, cp_size: int, cp_rank: int, device: Any) -> DSATokenLayout:
    layout = thd_layout(packed_seq_params, sq * cp_size)
    key = (layout, cp_size, cp_rank, str(device))
    cached = _LAYOUTS.get(key)
    if cached is not None:
        return cached
    starts = []
    for start, padded in zip(layout.starts, layout.padded):
        starts.extend([start] * padded)
    local = thd_partitioned_indices(layout, cp_size, cp_rank)
    positions = torch.tensor(local, dtype=torch.int64, device=device)
    doc_starts = torch.tensor([starts[i] for i in local], dtype=torch.int64, device=device)
    reorder = None
    if cp_size > 1:
        gathered = [i for r in range(cp_size) for i in thd_partitioned_indices(layout, cp_size, r)]
        reorder = torch.argsort(torch.tensor(gathered, dtype=torch.int64, device=device))
    if len(_LAYOUTS) > 64:
        _LAYOUTS.clear()
    _LAYOUTS[key] = cached = DSATokenLayout(positions, doc_starts, reorder)
    return cached


def dsa_token_layout(sq: int, cp_size: int, cp_rank: int, packed_seq_params: Any = None, device: Any = None
                     ) -> DSATokenLayout:
    """The layout of ``sq`` local query rows on CP rank ``cp_rank`` of ``cp_size``, packed (``qkv_format='thd'``,
    padded ``cu_seqlens`` over the whole micro-batch) or not."""
    if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
        return _packed_layout(packed_seq_params, sq, cp_size, cp_rank, device)
    positions = build_zigzag_cp_local_positions(sq * cp_size, cp_size, cp_rank, device)
    reorder = build_zigzag_allgather_cp_key_reorder(sq, cp_size, device) if cp_size > 1 else None
    return DSATokenLayout(positions, torch.zeros_like(positions), reorder)
