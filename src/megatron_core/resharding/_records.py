"""The planner's records: :class:`ParameterMetadata`, :class:`TransferOp`, :class:`ShardingDescriptor`,
:class:`ReshardPlan` (re-exported by :mod:`megatron_core.resharding.utils`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from megatron_core.resharding.transforms import ReshardTransform


@dataclass
class TransferOp:
    """One send or receive of a slice of one tensor; ``task_id`` is shared by the matching send and recv."""

    param_name: str
    peer_rank: int
    is_send: bool
    my_slice: tuple[slice, ...]
    peer_slice: tuple[slice, ...]
    task_id: int | None = None


@dataclass
class ParameterMetadata:
    """What the planner knows about one tensor held by ``owner_rank`` (gathered to every rank)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    element_size: int
    is_tp: bool = False
    partition_dim: int = 0
    partition_stride: int = 1
    partition_sizes: list[int] | None = None
    is_ep: bool = False
    num_experts: int | None = None
    owner_rank: int = -1
    tensor_parallel_group_ranks: list[int] | None = None
    expert_parallel_group_ranks: list[int] | None = None
    data_parallel_group_ranks: list[int] | None = None
    pipeline_parallel_group_ranks: list[int] | None = None
    resolved_name: str | None = None
    global_expert_index: int | None = None


@dataclass
class ShardingDescriptor:
    """One sharded dimension of a tensor: its label (``"tp"``/``"ep"``), strides and the ranks along it."""

    name: str
    dim: int
    src_stride: int
    dst_stride: int
    src_dim_ranks: list[int]
    dst_dim_ranks: list[int]


@dataclass
class ReshardPlan:
    """This rank's share of a reshard: the slices it sends and the slices it receives."""

    send_ops: list[TransferOp]
    recv_ops: list[TransferOp]
    transform: ReshardTransform | None = None
    buffer_dtypes: dict[str, torch.dtype] | None = None

    def __str__(self) -> str:
        return f"ReshardPlan(sends={len(self.send_ops)}, recvs={len(self.recv_ops)})"
