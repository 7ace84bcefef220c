"""Megatron-Core's path of fine-grained activation offloading; the code is in ``megatron_core._activation_offload``."""

from megatron_core._activation_offload.chunk_handler import ChunkOffloadHandler, OffloadTensorGroup
from megatron_core._activation_offload.interface import (
    FineGrainedActivationOffloadingInterface,
    FineGrainedOffloadingBackwardRecordFunction,
    FineGrainedOffloadingGroupCommitFunction,
    FineGrainedOffloadingGroupStartFunction,
    fine_grained_offloading_disable_offload,
    fine_grained_offloading_enable_offload,
    fine_grained_offloading_group_flush_delayed_groups,
    fine_grained_offloading_group_offload,
    fine_grained_offloading_group_start,
)
from megatron_core._activation_offload.manager import PipelineOffloadManager
from megatron_core._activation_offload.summary import print_offload_summary_table
from megatron_core._activation_offload.tensor_pool import OffloadTensorPool

__all__ = [
    "ChunkOffloadHandler",
    "FineGrainedActivationOffloadingInterface",
    "FineGrainedOffloadingBackwardRecordFunction",
    "FineGrainedOffloadingGroupCommitFunction",
    "FineGrainedOffloadingGroupStartFunction",
    "OffloadTensorGroup",
    "OffloadTensorPool",
    "PipelineOffloadManager",
    "fine_grained_offloading_disable_offload",
    "fine_grained_offloading_enable_offload",
    "fine_grained_offloading_group_flush_delayed_groups",
    "fine_grained_offloading_group_offload",
    "fine_grained_offloading_group_start",
    "print_offload_summary_table",
]
