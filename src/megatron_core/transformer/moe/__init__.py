"""Mixture of experts (``megatron.core.transformer.moe``): router, token dispatchers, experts and the MoE layer."""

from megatron_core.transformer.moe.experts import (
    GroupedMLP,
    GroupedMLPSubmodules,
    SequentialMLP,
    TEGroupedMLP,
)
from megatron_core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from megatron_core.transformer.moe.moe_layer import BaseMoELayer, MoELayer, MoESubmodules
from megatron_core.transformer.moe.moe_logging import MoEMetricsTracker, get_moe_metrics_tracker
from megatron_core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron_core.transformer.moe.router import Router, TopKRouter
from megatron_core.transformer.moe.shared_experts import SharedExpertMLP
from megatron_core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
    MoETokenDispatcher,
)

__all__ = [
    "BaseMoELayer",
    "ColumnParallelGroupedLinear",
    "GroupedMLP",
    "GroupedMLPSubmodules",
    "MoEAllGatherTokenDispatcher",
    "MoEAlltoAllTokenDispatcher",
    "MoEAuxLossAutoScaler",
    "MoELayer",
    "MoEMetricsTracker",
    "MoESubmodules",
    "MoETokenDispatcher",
    "Router",
    "RowParallelGroupedLinear",
    "SequentialMLP",
    "SharedExpertMLP",
    "TEGroupedMLP",
    "TopKRouter",
    "get_moe_metrics_tracker",
]
