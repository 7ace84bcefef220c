"""The few collectives checkpointing needs, in one place, usable with or without a process group.

Everything exchanged here is small metadata (shard descriptions, write results, error flags);
tensor data never travels between ranks: every rank reads and writes its own files.
Without an initialised process group the functions behave as a world of one rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (0 without a process group)."""
    return dist.get_rank(group) if _active() else 0


def get_world_size(group: Any = None) -> int:
    """Size of ``group`` (1 without a process group)."""
    return dist.get_world_size(group) if _active() else 1


def _flag_device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every rank's ``obj``, ordered by rank in ``group``."""
    if not _active():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src_group_rank: int = 0, group: Any = None) -> Any:
    """``obj`` of the rank ``src_group_rank`` of ``group``, on every rank."""
    if not _active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=src_group_rank, group=group)
    return box[0]


def any_rank_true(flag: bool, group: Any = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank of ``group``."""
    if not _active():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=_flag_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def barrier(group: Any = None) -> None:
    """Wait for every rank of ``group``."""
    if _active():
        dist.barrier(group=group)


def all_reduce_sum(tensor: torch.Tensor, group: Any = None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` in place (a no-op for a group of one); returns it."""
    if _active() and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, group=group)
    return tensor
