"""Shifting token-aligned tensors one token left for multi-token prediction (Megatron-Core's ``roll_tensor`` of
``transformer.multi_token_prediction``, which re-exports it).

Each MTP depth sees the ids, positions, labels and loss mask one token further ahead, zero-filled at the end of
every sequence. Under context parallelism a rank holds two mirrored chunks of each sequence (``r`` and
``2 * cp - 1 - r``), so each chunk's first token travels to the neighbouring chunk's last slot, on another rank
(one point-to-point exchange each way); with packed sequences each sequence is shifted on its own, so no token
crosses a sequence boundary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size

__all__ = ["roll_tensor"]


def _shift_left_within(segment: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``segment`` (last axis = this rank's part of one sequence) shifted left by one token, zero-filled at the
    sequence's end. Under context parallelism the rank holds chunks ``r`` and ``2 * cp - 1 - r``: each chunk's
    first token goes to the neighbouring chunk's last slot."""
    cp_size = get_pg_size(cp_group)
    if cp_size == 1:
        out = torch.roll(segment, -1, dims=-1)
        out[..., -1] = 0
        return out
    front, back = (torch.roll(chunk, -1, dims=-1) for chunk in segment.chunk(2, dim=-1))
    rank, ranks = get_pg_rank(cp_group), dist.get_process_group_ranks(cp_group)
    # front chunk r's last slot <- chunk r + 1's first token (the next rank's front; for the last rank, its
    # own back chunk); back chunk's last slot <- chunk (2cp - 1 - r) + 1 = the previous rank's back chunk.
    recv_front = torch.empty_like(front[..., -1])
    recv_back = torch.empty_like(back[..., -1])
    ops = []
    if rank != 0:
        ops += [dist.P2POp(dist.isend, front[..., -1].contiguous(), ranks[rank - 1]),
                dist.P2POp(dist.irecv, recv_back, ranks[rank - 1])]
    else:
        recv_back.zero_()
    if rank != cp_size - 1:
        ops += [dist.P2POp(dist.irecv, recv_front, ranks[rank + 1]),
                dist.P2POp(dist.isend, back[..., -1].contiguous(), ranks[rank + 1])]
    else:
        recv_front.copy_(back[..., -1])
    for request in dist.batch_isend_irecv(ops) if ops else []:
        request.wait()
    front[..., -1] = recv_front
    back[..., -1] = recv_back
    return torch.cat([front, back], dim=-1)


def roll_tensor(tensor: torch.Tensor | None, shifts: int = -1, dims: int = -1, cp_group: Any = None,
                packed_seq_params: Any = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(tensor shifted left by one token along the sequence axis, its sum)``, zero-filled at each sequence's end.

    ``tensor`` is ``[..., s]`` (ids, labels or a mask; the sequence is the last axis). With ``cp_group`` of size
    > 1 the tokens of this rank's two chunks are exchanged with the neighbouring ranks; with
    ``packed_seq_params`` (``cu_seqlens_q`` over the packed tokens, before the context-parallel split) each
    sequence is shifted on its own. Only ``shifts=-1`` along the last axis is supported, as in Megatron-Core.
    """
    if tensor is None:
        return None, None
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"roll_tensor shifts one token left along the last axis (shifts=-1, dims=-1); "
                         f"got shifts={shifts}, dims={dims}")
    if packed_seq_params is None:
        rolled = _shift_left_within(tensor, cp_group)
        return rolled, rolled.sum()
    cu_seqlens = packed_seq_params.cu_seqlens_q
    if cu_seqlens is None:
        raise ValueError("roll_tensor with packed sequences needs packed_seq_params.cu_seqlens_q")
    cp_size = get_pg_size(cp_group)
    rolled = tensor.clone()
    bounds = [int(b) // cp_size for b in cu_seqlens.tolist()]
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            rolled[..., start:end] = _shift_left_within(tensor[..., start:end], cp_group)
    return rolled, rolled.sum()
