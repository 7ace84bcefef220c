"""Hybrid (dynamic) context-parallel groups: power-of-two slices of each DP x CP group.

With hybrid context parallelism a micro-batch's sample may run on a CP group of any power-of-two
size up to the DP x CP size; these are the groups it picks from. ``initialize_model_parallel``
builds them when ``hybrid_context_parallel=True``; the full DP x CP group serves the largest size.
"""

from __future__ import annotations

from datetime import timedelta
from math import log2
from typing import Any

import torch.distributed as dist

from megatron_core.parallel_state import registry as _ps
from megatron_core.parallel_state.extras import create_group
from megatron_core.parallel_state.rank_generator import ParallelConfigError

__all__ = [
    "create_hybrid_dp_cp_groups",
    "get_hybrid_data_context_parallel_groups",
    "hybrid_dp_cp_group_sizes",
    "hybrid_dp_cp_rank_lists",
]


def hybrid_dp_cp_group_sizes(dp_cp_size: int) -> list[int]:
    """The sizes of the hybrid groups built over ``dp_cp_size`` ranks: 2, 4, ... below ``dp_cp_size``.

    Sizes run over ``2**i`` for ``1 <= i < floor(log2(dp_cp_size))``; size 1 needs no group and the
    whole DP x CP group stands for ``dp_cp_size`` itself.
    """
    if dp_cp_size < 2 or dp_cp_size % 2:
        raise ParallelConfigError(
            f"hybrid_context_parallel needs an even DP x CP size of at least 2 (data_parallel_size x "
            f"context_parallel_size = {dp_cp_size})"
        )
    return [2**i for i in range(1, int(log2(dp_cp_size)))]


def hybrid_dp_cp_rank_lists(ranks: list[int]) -> dict[int, list[list[int]]]:
    """For one DP x CP group's ``ranks``: group size -> the consecutive slices of that size."""
    return {size: [list(ranks[i:i + size]) for i in range(0, len(ranks), size)]
            for size in hybrid_dp_cp_group_sizes(len(ranks))}


def create_hybrid_dp_cp_groups(rank: int, ranks: list[int], pg_options: Any = None) -> dict[int, dist.ProcessGroup]:
    """Create the hybrid groups of one DP x CP group (a collective call on every rank of the job).

    Returns group size -> the group of that size holding ``rank`` (empty when ``rank`` is not in ``ranks``).
    """
    groups: dict[int, dist.ProcessGroup] = {}
    for size, slices in hybrid_dp_cp_rank_lists(list(ranks)).items():
        for members in slices:
            group = create_group(members, pg_options=pg_options, group_desc=f"HYBRID_DP_CP_GROUP_{size}")
            if rank in members:
                groups[size] = group
    return groups


def _new_hybrid_dp_cp_groups(dp_cp_groups: list[list[int]], timeout: timedelta) -> None:
    """Register the hybrid groups of every DP x CP group as ``hybrid_dp_cp_<size>`` in the registry."""
    per_size: dict[int, list[list[int]]] = {}
    for ranks in dp_cp_groups:
        for size, slices in hybrid_dp_cp_rank_lists(ranks).items():
            per_size.setdefault(size, []).extend(slices)
    for size, slices in per_size.items():
        _ps._new_group(f"hybrid_dp_cp_{size}", slices, timeout)
    _ps._HYBRID_DP_CP_SIZES[:] = sorted(per_size)


def get_hybrid_data_context_parallel_groups(check_initialized: bool = True,
                                            group_size: int | None = None) -> dist.ProcessGroup | None:
    """This rank's hybrid DP x CP group of ``group_size`` ranks.

    ``group_size`` equal to the DP x CP size gives the DP x CP group itself; other sizes need
    ``initialize_model_parallel(hybrid_context_parallel=True)``. With ``check_initialized=False`` a
    size that has no group gives None instead of raising ``ValueError``.
    """
    dp_cp = _ps._group("dp_cp", check_initialized)
    if dp_cp is None:
        return None
    if group_size == dist.get_world_size(dp_cp):
        return dp_cp
    group = _ps._GROUPS.get(f"hybrid_dp_cp_{group_size}")
    if group is None and check_initialized:
        raise ValueError(
            f"get_hybrid_data_context_parallel_groups: no hybrid DP x CP group of group_size={group_size!r}; "
            f"available sizes are {_ps._HYBRID_DP_CP_SIZES + [dist.get_world_size(dp_cp)]} "
            "(initialize_model_parallel(hybrid_context_parallel=True) builds the power-of-two sizes)"
        )
    return group
