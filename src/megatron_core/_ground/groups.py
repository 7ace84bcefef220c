"""Size and rank of a process group, where ``None`` means "no group" (one process), never WORLD."""

from __future__ import annotations

from typing import Any

import torch


def get_pg_size(group: Any = None) -> int:
    """Number of ranks in ``group``: 1 when ``group`` is None or ``torch.distributed`` is not initialised.

    As in Megatron-Core, ``None`` here means "no group" (no parallelism), never the WORLD group.
    """
    if group is None or not torch.distributed.is_initialized():
        return 1
    return group.size()


def get_pg_rank(group: Any = None) -> int:
    """This rank's index in ``group``: 0 when ``group`` is None or ``torch.distributed`` is not initialised."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return group.rank()


def get_pg_src_rank(group: Any = None) -> int:
    """Global rank of ``group``'s first member: 0 when ``group`` is None or nothing is initialised."""
    if group is None or not torch.distributed.is_initialized():
        return 0
    return torch.distributed.get_process_group_ranks(group)[0]
