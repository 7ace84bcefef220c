"""Resharding ("refit"): copy model weights between parallel layouts (TP, PP, EP, DP), e.g. training to inference.

Every rank gathers both models' tensor metadata, replays one deterministic transfer schedule and keeps its
own sends and receives (:mod:`.planner`); :mod:`.execution` runs them over a copy service
(:mod:`.copy_services`). :func:`swap_model_weights` is the entry point.
"""

from megatron_core.resharding.execution import execute_reshard_plan
from megatron_core.resharding.planner import (
    build_centralized_reshard_plan,
    build_local_reshard_plan,
    build_plan_from_rosters,
    index_metadata_rosters,
)
from megatron_core.resharding.refit import (
    clear_service_cache,
    get_or_create_service,
    reshard_model_weights,
    swap_model_weights,
)
from megatron_core.resharding.transforms import MXFP8ReshardTransform, ReshardTransform
from megatron_core.resharding.utils import ParameterMetadata, ReshardPlan, ShardingDescriptor, TransferOp

__all__ = [
    "MXFP8ReshardTransform",
    "ParameterMetadata",
    "ReshardPlan",
    "ReshardTransform",
    "ShardingDescriptor",
    "TransferOp",
    "build_centralized_reshard_plan",
    "build_local_reshard_plan",
    "build_plan_from_rosters",
    "clear_service_cache",
    "execute_reshard_plan",
    "get_or_create_service",
    "index_metadata_rosters",
    "reshard_model_weights",
    "swap_model_weights",
]
