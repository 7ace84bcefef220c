"""Carrying out KV and Mamba reshard plans with point-to-point sends (this library's executor; Megatron-Core
0.19 ships the planners only).

Every rank of the job computes the same plan from the same layouts (:func:`exchange_layouts` gathers them),
then calls :func:`execute_kv_reshard` / :func:`execute_mamba_reshard` with its own side: a sending rank its
layout and cache, a receiving rank its own, a rank of neither role nothing. Each sender packs everything it
owes one receiver into one contiguous message (KV: ``[layers, 2 (key, value), tokens, heads, head_dim]``;
Mamba: the conv pieces and the SSM pieces of every layer and band, flattened, one message each), and the
receiver unpacks them into its slots in plan order, which both sides know. The sends are
``torch.distributed`` ``isend`` / ``irecv`` between global ranks over ``group`` (default: the world; a group
that holds both shards), gloo on CPU and NCCL on GPU; a rank that is its own peer copies locally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from megatron_core.inference.disaggregation.cache_views import MambaStateCache, PagedKVCache
from megatron_core.inference.disaggregation.kv_reshard import KVReshardTransfer, KVShardLayout
from megatron_core.inference.disaggregation.mamba_reshard import MambaReshardTransfer
from megatron_core.inference.disaggregation.utils import transfers_for_dst, transfers_for_src

__all__ = ["exchange_layouts", "execute_kv_reshard", "execute_mamba_reshard"]

Layout = TypeVar("Layout")
_KV_TAG, _CONV_TAG, _SSM_TAG = 11, 12, 13


def exchange_layouts(src_layout: Layout | None, dst_layout: Layout | None, group: Any = None
                     ) -> tuple[list[Layout], list[Layout]]:
    """``(every sender's layout, every receiver's layout)`` in rank order, from each rank's own (``None`` for a
    role it does not play). Collective over ``group``: every rank of it calls this."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (src_layout, dst_layout), group=group)
    return [s for s, _ in gathered if s is not None], [d for _, d in gathered if d is not None]


def _mine(plan: Sequence[Any], rank: int, src: Any, dst: Any, name: str) -> tuple[list[Any], list[Any]]:
    """This rank's sends and receives; ``ValueError`` when the plan gives it a role it brought no cache for."""
    sends, recvs = transfers_for_src(plan, rank), transfers_for_dst(plan, rank)
    if sends and src is None:
        raise ValueError(f"{name}: the plan has rank {rank} send {len(sends)} transfers but src is None")
    if recvs and dst is None:
        raise ValueError(f"{name}: the plan has rank {rank} receive {len(recvs)} transfers but dst is None")
    return sends, recvs


def _by_peer(transfers: list[Any], peer: Callable[[Any], int]) -> dict[int, list[Any]]:
    """``transfers`` grouped by peer rank, each group in plan order, peers in order of first appearance."""
    groups: dict[int, list[Any]] = {}
    for t in transfers:
        groups.setdefault(peer(t), []).append(t)
    return groups


def _exchange(outgoing: dict[tuple[int, int], torch.Tensor], incoming: dict[tuple[int, int], torch.Tensor],
              rank: int, group: Any) -> None:
    """Send ``outgoing[(peer, tag)]``, receive into ``incoming[(peer, tag)]`` (a rank's own messages are copied)."""
    requests = []
    for (peer, tag), tensor in outgoing.items():
        if peer != rank:
            requests.append(dist.isend(tensor, peer, group=group, tag=tag))
    for (peer, tag), buffer in incoming.items():
        if peer == rank:
            buffer.copy_(outgoing[(peer, tag)])
        else:
            requests.append(dist.irecv(buffer, peer, group=group, tag=tag))
    for request in requests:
        request.wait()


def _pack_kv(t: KVReshardTransfer, layout: KVShardLayout, cache: PagedKVCache) -> torch.Tensor:
    layers, heads = t.src_layer_slice(layout), t.src_head_slice(layout)
    pieces = [torch.stack((cache.keys[i][cache.slots, heads], cache.values[i][cache.slots, heads]))
              for i in range(layers.start, layers.stop)]
    return torch.stack(pieces).contiguous()  # [layers, 2, tokens, heads, head_dim]


def execute_kv_reshard(plan: Sequence[KVReshardTransfer], src: tuple[KVShardLayout, PagedKVCache] | None = None,
                       dst: tuple[KVShardLayout, PagedKVCache] | None = None, group: Any = None) -> None:
    """Move this rank's part of a :func:`~.kv_reshard.plan_kv_reshard` plan.

    ``src`` / ``dst`` are this rank's layout and cache (:func:`~.cache_views.context_kv_cache`) as a sender /
    receiver, ``None`` for a role it does not play. Both sides' caches must list the same requests with the
    same token counts; a receiver's slots must already belong to those requests
    (:func:`~.cache_views.admit_transferred_request`). Every transfer's keys and values land in the receiver's
    slots, in the heads and layers the transfer names; nothing else of its cache changes.
    """
    rank = dist.get_rank()
    sends, recvs = _mine(plan, rank, src, dst, "execute_kv_reshard")
    outgoing = {(t.dst_rank, _KV_TAG): _pack_kv(t, *src) for t in sends if src[1].slots.numel()}
    incoming = {}
    if dst is not None and dst[1].slots.numel():
        cache = dst[1]
        like = cache.keys[0]
        for t in recvs:
            shape = (t.global_layer_hi - t.global_layer_lo, 2, cache.slots.numel(),
                     t.global_head_hi - t.global_head_lo, like.shape[-1])
            incoming[(t.src_rank, _KV_TAG)] = torch.empty(shape, dtype=like.dtype, device=like.device)
    _exchange(outgoing, incoming, rank, group)
    for t in recvs:
        block = incoming.get((t.src_rank, _KV_TAG))
        if block is None:
            continue
        layout, cache = dst
        layers, heads = t.dst_layer_slice(layout), t.dst_head_slice(layout)
        for j, i in enumerate(range(layers.start, layers.stop)):
            cache.keys[i][:, heads].index_copy_(0, cache.slots, block[j, 0])
            cache.values[i][:, heads].index_copy_(0, cache.slots, block[j, 1])


def _mamba_piece(t: MambaReshardTransfer, cache: MambaStateCache) -> torch.Tensor:
    """The source states a transfer reads: ``[requests, width, ...]`` of one layer."""
    states = cache.conv[t.src_layer] if t.is_conv else cache.ssm[t.src_layer]
    return states[cache.slots, t.src_lo : t.src_hi]


def _piece_numel(t: MambaReshardTransfer, cache: MambaStateCache) -> int:
    """Elements a receiver gets for transfer ``t``: requests x width x one channel's (head's) state."""
    states = cache.conv[t.dst_layer] if t.is_conv else cache.ssm[t.dst_layer]
    return cache.slots.numel() * (t.dst_hi - t.dst_lo) * states[0, 0].numel()


def execute_mamba_reshard(plan: Sequence[MambaReshardTransfer], src: MambaStateCache | None = None,
                          dst: MambaStateCache | None = None, group: Any = None) -> None:
    """Move this rank's part of a :func:`~.mamba_reshard.plan_mamba_reshard` plan.

    ``src`` / ``dst`` are this rank's states (:func:`~.cache_views.context_mamba_states`) as a sender / receiver,
    ``None`` for a role it does not play; both sides list the same requests in the same order. Per peer, the
    conv pieces travel as one message and the SSM pieces as another.
    """
    rank = dist.get_rank()
    sends, recvs = _mine(plan, rank, src, dst, "execute_mamba_reshard")
    outgoing: dict[tuple[int, int], torch.Tensor] = {}
    if src is not None and src.slots.numel():
        for peer, transfers in _by_peer(sends, lambda t: t.dst_rank).items():
            for tag, conv in ((_CONV_TAG, True), (_SSM_TAG, False)):
                pieces = [_mamba_piece(t, src).reshape(-1) for t in transfers if t.is_conv == conv]
                if pieces:
                    outgoing[(peer, tag)] = torch.cat(pieces)
    incoming: dict[tuple[int, int], torch.Tensor] = {}
    layout_of: dict[tuple[int, int], list[MambaReshardTransfer]] = {}
    if dst is not None and dst.slots.numel():
        for peer, transfers in _by_peer(recvs, lambda t: t.src_rank).items():
            for tag, conv in ((_CONV_TAG, True), (_SSM_TAG, False)):
                mine = [t for t in transfers if t.is_conv == conv]
                if mine:
                    like = dst.conv[0] if conv else dst.ssm[0]
                    count = sum(_piece_numel(t, dst) for t in mine)
                    incoming[(peer, tag)] = torch.empty(count, dtype=like.dtype, device=like.device)
                    layout_of[(peer, tag)] = mine
    _exchange(outgoing, incoming, rank, group)
    for key, buffer in incoming.items():
        offset = 0
        for t in layout_of[key]:
            layer, lo, hi = t.dst_layer, t.dst_lo, t.dst_hi
            states = dst.conv[layer] if t.is_conv else dst.ssm[layer]
            count = _piece_numel(t, dst)
            piece = buffer[offset : offset + count].view(dst.slots.numel(), hi - lo, *states.shape[2:])
            states[:, lo:hi].index_copy_(0, dst.slots, piece)
            offset += count
