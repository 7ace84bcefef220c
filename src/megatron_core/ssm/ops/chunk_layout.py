"""Token positions of the chunks of a packed (varlen) sequence batch, for the PyTorch paths of :mod:`megatron_core.ssm.ops`.

Megatron-Core 0.19's varlen SSD ops describe a packed batch ``[total_tokens, ...]`` by ``cu_chunk_seqlens``
``[nchunks + 1]``: chunk ``c`` is the tokens ``cu_chunk_seqlens[c] : cu_chunk_seqlens[c + 1]`` (at most
``chunk_size`` of them, all of one sequence; ``seq_idx[c]`` names that sequence). The PyTorch paths lay each chunk
out as one row of ``chunk_size`` positions, padded past its end, and gather the tokens with :func:`chunk_positions`.
"""

from __future__ import annotations

import torch

__all__ = ["chunk_positions", "gather_chunks"]


def chunk_positions(cu_chunk_seqlens: torch.Tensor, chunk_size: int, total_tokens: int,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(positions [nchunks, chunk_size] int64, valid [nchunks, chunk_size] bool)``: the token of each chunk row
    (clamped into ``[0, total_tokens)`` on padding) and whether it is one of the chunk's tokens."""
    cu = cu_chunk_seqlens.to(device=device, dtype=torch.int64)
    offsets = torch.arange(chunk_size, device=device)
    positions = cu[:-1, None] + offsets
    valid = offsets < (cu[1:] - cu[:-1])[:, None]
    return positions.clamp(0, max(total_tokens - 1, 0)), valid


def gather_chunks(t: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``t`` ``[total_tokens, ...]`` laid out as ``[nchunks, chunk_size, ...]`` in fp32, zeros on padding."""
    out = t.float()[positions]
    return out * valid.view(*valid.shape, *([1] * (out.dim() - 2)))
