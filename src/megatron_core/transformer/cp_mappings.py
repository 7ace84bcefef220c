"""Context-parallel communication with autograd (the CP counterpart of ``tensor_parallel.mappings``).

Activations are ``[s, b, heads, d]`` with the sequence first. ``all_gather_sequence`` gathers
key/value along the sequence (backward: reduce-scatter); ``sequence_to_heads`` /
``heads_to_sequence`` are the Ulysses all-to-all pair (each rank trades its sequence slice of every
head for the whole sequence of ``heads / cp`` heads; each is the other's backward);
``ring_exchange`` posts the asynchronous send-to-next / receive-from-previous of ring attention.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.mappings import (
    _all_to_all_single,
    _gather_along_first_dim,
    _reduce_scatter_along_first_dim,
)

__all__ = ["all_gather_sequence", "heads_to_sequence", "ring_exchange", "sequence_to_heads"]


class _AllGatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _gather_along_first_dim(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter_along_first_dim(grad.contiguous(), ctx.group), None


def all_gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every CP rank's ``x`` along dim 0 in rank order; gradients are reduce-scattered."""
    if group is None or get_pg_size(group) == 1:
        return x
    return _AllGatherSequence.apply(x, group)


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = get_pg_size(group)
    s, b, h, d = x.shape
    if h % n != 0:
        raise ValueError(f"cp_comm_type 'a2a' needs the heads on this rank ({h}) divisible by the a2a size ({n})")
    parts = x.reshape(s, b, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    out = _all_to_all_single(parts, group)  # out[i] = rank i's sequence slice of my head group
    return out.reshape(n * s, b, h // n, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    n = get_pg_size(group)
    s_full, b, h, d = x.shape
    parts = x.reshape(n, s_full // n, b, h, d).contiguous()
    out = _all_to_all_single(parts, group)  # out[j] = my sequence slice of head group j
    return out.permute(1, 2, 0, 3, 4).reshape(s_full // n, b, n * h, d)


class _SequenceToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad, ctx.group), None


def sequence_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``[s/n, b, h, d]`` on each of ``n`` ranks -> ``[s, b, h/n, d]`` (rank-ordered sequence slices)."""
    if group is None or get_pg_size(group) == 1:
        return x
    return _SequenceToHeads.apply(x, group)


def heads_to_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse of :func:`sequence_to_heads`: ``[s, b, h/n, d]`` -> ``[s/n, b, h, d]``."""
    if group is None or get_pg_size(group) == 1:
        return x
    return _HeadsToSequence.apply(x, group)


def ring_exchange(tensor: torch.Tensor, group: Any) -> tuple[torch.Tensor, list]:
    """Post ``send(tensor) -> next rank`` and ``recv <- previous rank``; returns ``(recv buffer, works)``.

    Call ``work.wait()`` on every work before reading the buffer. A group of one returns ``tensor``.
    """
    n = get_pg_size(group)
    if n == 1:
        return tensor, []
    rank = get_pg_rank(group)
    ranks = dist.get_process_group_ranks(group)
    tensor = tensor.contiguous()
    recv = torch.empty_like(tensor)
    ops = [
        dist.P2POp(dist.isend, tensor, ranks[(rank + 1) % n], group),
        dist.P2POp(dist.irecv, recv, ranks[(rank - 1) % n], group),
    ]
    return recv, dist.batch_isend_irecv(ops)
