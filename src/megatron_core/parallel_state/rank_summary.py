"""``get_all_ranks``: this process's ranks in its parallel groups as one string (Megatron-Core's format)."""

from __future__ import annotations

from megatron_core.parallel_state.expert_groups import get_expert_model_parallel_rank
from megatron_core.parallel_state.model_groups import (
    get_context_parallel_rank,
    get_data_parallel_rank,
    get_pipeline_model_parallel_rank,
    get_tensor_model_parallel_rank,
)

__all__ = ["get_all_ranks"]


def get_all_ranks() -> str:
    """This process's tensor, GTP weight-remat, data, context, pipeline and expert parallel ranks joined by ``_``
    (``"tp_gtp_dp_cp_pp_ep"``, 0 where a group is not set up; GTP is not implemented here, so always 0)."""
    ranks = (get_tensor_model_parallel_rank(), 0, get_data_parallel_rank(), get_context_parallel_rank(),
             get_pipeline_model_parallel_rank(), get_expert_model_parallel_rank())
    return "_".join(str(rank or 0) for rank in ranks)
