"""Per-chunk ``C B^T`` products of the varlen SSD scan (Megatron-Core 0.19's ``ssm.ops.ssd_bmm``), in PyTorch."""

from __future__ import annotations

import torch

from megatron_core.ssm.ops.chunk_layout import chunk_positions, gather_chunks

__all__: list[str] = []


def _bmm_chunk_fwd(a: torch.Tensor, b: torch.Tensor, chunk_size: int, cu_chunk_seqlens: torch.Tensor,
                   causal: bool = False, output_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[c, g, i, j] = a[i] . b[j]`` over the tokens ``i, j`` of chunk ``c`` (zeros past its end):
    ``a``/``b`` ``[seqlen, ngroups, k]`` -> ``[nchunks, ngroups, chunk_size, chunk_size]`` in ``output_dtype``
    (default ``a``'s). fp32 products. ``causal`` is accepted for 0.19's signature: every entry is computed."""
    if a.shape != b.shape:
        raise ValueError(f"_bmm_chunk_fwd: a {tuple(a.shape)} and b {tuple(b.shape)} must match")
    positions, valid = chunk_positions(cu_chunk_seqlens, chunk_size, a.shape[0], a.device)
    ac, bc = gather_chunks(a, positions, valid), gather_chunks(b, positions, valid)  # [c, q, g, k]
    return torch.einsum("cigk,cjgk->cgij", ac, bc).to(output_dtype or a.dtype)
