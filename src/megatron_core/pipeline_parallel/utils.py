"""Pipeline-stage predicates on an explicit pipeline group (Megatron-Core's ``pipeline_parallel.utils``).

Unlike ``parallel_state.is_pipeline_first_stage``, these take the pipeline process group (and the
virtual stage and virtual size) as arguments. A ``None`` group, or no initialised
``torch.distributed``, means a single stage. ``set_ideal_affinity_for_current_gpu`` (CPU pinning
next to the GPU) lives in :mod:`megatron_core.pipeline_parallel.cpu_affinity` and is re-exported here, and the
combined 1F1B schedule's nodes and streams (``ScheduleNode``, ``AbstractSchedulePlan``, ``set_streams``, ...) in
:mod:`megatron_core.pipeline_parallel.schedule_node`.
"""

from __future__ import annotations

import torch

from megatron_core.pipeline_parallel.cpu_affinity import set_ideal_affinity_for_current_gpu
from megatron_core.pipeline_parallel.schedule_node import (
    AbstractSchedulePlan,
    NoopScheduleNode,
    ScheduleNode,
    get_comm_stream,
    get_comp_stream,
    make_viewless,
    set_streams,
)

__all__ = [
    "AbstractSchedulePlan",
    "NoopScheduleNode",
    "ScheduleNode",
    "get_comm_stream",
    "get_comp_stream",
    "get_pp_first_rank",
    "get_pp_last_rank",
    "get_pp_next_rank",
    "get_pp_prev_rank",
    "is_pp_first_stage",
    "is_pp_last_stage",
    "is_vp_first_stage",
    "is_vp_last_stage",
    "make_viewless",
    "set_ideal_affinity_for_current_gpu",
    "set_streams",
]


def _rank(group: torch.distributed.ProcessGroup | None) -> int:
    from megatron_core._ground import get_pg_rank

    return get_pg_rank(group)


def _size(group: torch.distributed.ProcessGroup | None) -> int:
    from megatron_core._ground import get_pg_size

    return get_pg_size(group)


def is_pp_first_stage(pp_group: torch.distributed.ProcessGroup | None) -> bool:
    """True on the first stage of ``pp_group``."""
    return _rank(pp_group) == 0


def is_pp_last_stage(pp_group: torch.distributed.ProcessGroup | None) -> bool:
    """True on the last stage of ``pp_group``."""
    return _rank(pp_group) == _size(pp_group) - 1


def _check_vp(vp_stage: int | None, vp_size: int | None) -> bool:
    """True when there is no virtual pipeline; ``ValueError`` for a stage that cannot exist."""
    if vp_size is None or vp_size <= 1:
        if vp_stage not in (None, 0):
            raise ValueError(f"vp_stage={vp_stage} needs vp_size > 1 (got vp_size={vp_size})")
        return True
    if vp_stage is None or not 0 <= vp_stage < vp_size:
        raise ValueError(f"vp_stage={vp_stage} must be in [0, vp_size={vp_size})")
    return False


def is_vp_first_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """True for the first virtual stage (always, without a virtual pipeline)."""
    return True if _check_vp(vp_stage, vp_size) else vp_stage == 0


def is_vp_last_stage(vp_stage: int | None, vp_size: int | None) -> bool:
    """True for the last virtual stage (always, without a virtual pipeline)."""
    return True if _check_vp(vp_stage, vp_size) else vp_stage == vp_size - 1


def get_pp_first_rank(pp_group: torch.distributed.ProcessGroup) -> int:
    """Global rank of the first stage of ``pp_group``."""
    return torch.distributed.get_process_group_ranks(pp_group)[0]


def get_pp_last_rank(pp_group: torch.distributed.ProcessGroup) -> int:
    """Global rank of the last stage of ``pp_group``."""
    return torch.distributed.get_process_group_ranks(pp_group)[-1]


def get_pp_next_rank(pp_group: torch.distributed.ProcessGroup) -> int | None:
    """Global rank of the next stage, or None on the last stage."""
    if is_pp_last_stage(pp_group):
        return None
    return torch.distributed.get_process_group_ranks(pp_group)[_rank(pp_group) + 1]


def get_pp_prev_rank(pp_group: torch.distributed.ProcessGroup) -> int | None:
    """Global rank of the previous stage, or None on the first stage."""
    if is_pp_first_stage(pp_group):
        return None
    return torch.distributed.get_process_group_ranks(pp_group)[_rank(pp_group) - 1]
