"""The transport interface of resharding: queue sends and receives, then run them as one batch.

A :class:`CopyService` is given ``(tensor, peer rank, task_id)`` for every send and receive of a plan and
moves the data in :meth:`CopyService.run`. Transfers to the rank itself are paired by ``task_id`` and done
as a local copy (:func:`match_local_ops_by_task_id`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CopyService", "RecvOp", "SendOp", "match_local_ops_by_task_id"]


@dataclass
class SendOp:
    """A queued send of ``tensor`` to ``dest_rank``."""

    task_id: int | None
    tensor: torch.Tensor
    dest_rank: int


@dataclass
class RecvOp:
    """A queued receive into ``tensor`` from ``src_rank``."""

    task_id: int | None
    tensor: torch.Tensor
    src_rank: int


class CopyService(ABC):
    """Batched point-to-point copies over ``group`` (default: the world); ranks are ranks of that group."""

    requires_process_group_barrier = True

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.rank = group.rank() if group is not None else dist.get_rank()
        self.world_size = group.size() if group is not None else dist.get_world_size()

    @abstractmethod
    def submit_send(self, src_tensor: torch.Tensor, dest_rank: int, task_id: int | None = None) -> None:
        """Queue a send of ``src_tensor`` to ``dest_rank``."""

    @abstractmethod
    def submit_recv(self, dest_tensor: torch.Tensor, src_rank: int, task_id: int | None = None) -> None:
        """Queue a receive into ``dest_tensor`` from ``src_rank``."""

    @abstractmethod
    def run(self) -> None:
        """Carry out every queued send and receive; return when this rank's are complete."""

    def close(self) -> None:  # noqa: B027 - optional hook; most transports own nothing to release
        """Release resources the service owns (none by default)."""


def match_local_ops_by_task_id(local_sends: list, local_recvs: list, backend_name: str,
                               rank: int) -> list[tuple]:
    """Pair this rank's sends to itself with its receives from itself by ``task_id``: ``[(send, recv)]``.

    ``RuntimeError`` when an op has no ``task_id``, ids repeat, or a send or receive has no partner.
    """
    sends = {op.task_id: op for op in local_sends}
    recvs = {op.task_id: op for op in local_recvs}
    if None in sends or None in recvs:
        raise RuntimeError(f"{backend_name}: a copy to the same rank needs a task_id to pair send and recv")
    if len(sends) != len(local_sends) or len(recvs) != len(local_recvs) or len(sends) != len(recvs):
        raise RuntimeError(f"{backend_name}: unmatched local ops on rank {rank}: {len(local_sends)} sends, "
                           f"{len(local_recvs)} recvs")
    pairs = []
    for task_id, recv in recvs.items():
        if task_id not in sends:
            raise RuntimeError(f"{backend_name}: no local send for task_id={task_id} on rank {rank}")
        pairs.append((sends[task_id], recv))
    return pairs


def local_copies(pairs: list[tuple]) -> None:
    """Copy every paired send tensor into its receive tensor (across devices when they differ)."""
    with torch.no_grad():
        for send, recv in pairs:
            recv.tensor.copy_(send.tensor)


def peer_kwargs(group: Any, peer: int) -> dict:
    """``P2POp`` keyword arguments naming ``peer`` as a rank of ``group`` (a world rank without a group)."""
    return {"peer": peer} if group is None else {"group": group, "group_peer": peer}
