"""How parameters are placed in DDP's contiguous buffers (Megatron-Core 0.19 ``optimizer.param_layout``, which re-exports it).

A layout is computed before DDP allocates its buffers: :func:`~megatron_core.distributed.param_and_grad_buffer.\
group_params_for_buffers` splits the parameters into buffers (:class:`BufferKey`), and each buffer's
:class:`PerBufferParamLayout` gives every parameter its ``[start, end)`` range and bucket. Without a
distributed optimizer the layout has no padding; :func:`~megatron_core.distributed.param_and_grad_buffer.\
compute_full_param_layout` (Megatron-Core's ``DistributedOptimizer.compute_full_param_layout``) aligns each
parameter start to 64 elements and pads each bucket end so that it splits evenly across data-parallel ranks.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

PARAM_START_ALIGNMENT = 64
BUCKET_END_ALIGNMENT = 128
HIGH_NCCL_BUSBW_ALIGNMENT = 2**16


def pad_to_divisor(value: int, divisor: int) -> int:
    """``value`` rounded up to a multiple of ``divisor``."""
    return -(-value // divisor) * divisor


def pad_param_start(param_start_index: int) -> int:
    """A parameter's start index rounded up to a multiple of 64 elements."""
    return pad_to_divisor(param_start_index, PARAM_START_ALIGNMENT)


def bucket_end_divisor(data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """What a bucket's end is padded to: ``lcm(dp, 128)``, times ``2**16``-alignment for high NCCL bus bandwidth."""
    if pad_for_high_nccl_busbw:
        return math.lcm(data_parallel_world_size, BUCKET_END_ALIGNMENT, HIGH_NCCL_BUSBW_ALIGNMENT)
    return math.lcm(data_parallel_world_size, BUCKET_END_ALIGNMENT)


def pad_bucket_end(bucket_end_index: int, data_parallel_world_size: int, pad_for_high_nccl_busbw: bool) -> int:
    """A bucket's end index padded by :func:`bucket_end_divisor`, so it splits evenly across DP ranks."""
    return pad_to_divisor(bucket_end_index, bucket_end_divisor(data_parallel_world_size, pad_for_high_nccl_busbw))


@dataclass(frozen=True)
class BufferKey:
    """Which buffer a parameter belongs to; every distinct key is a separate contiguous buffer.

    Attributes:
        param_dtype: the storage dtype (``torch.uint8`` for FP8/NVFP4 parameters, else ``param.dtype``).
        grad_dtype: the dtype gradients are reduced in.
        is_expert_parallel: expert parameters (``param.allreduce == False``), reduced over the expert
            data-parallel group.
        is_managed_by_layer_wise_optimizer: parameters of the layer-wise distributed optimizer.
    """

    param_dtype: torch.dtype
    grad_dtype: torch.dtype
    is_expert_parallel: bool
    is_managed_by_layer_wise_optimizer: bool = False


@dataclass
class PerBufferParamLayout:
    """The placement of the parameters of one buffer.

    Attributes:
        param_index_map: parameter -> ``(start_index, end_index, bucket_id)`` in the buffer.
        bucket_indices: ``(start_index, end_index)`` of every bucket (end padded where the layout pads).
        per_bucket_numel_unpadded: every bucket's extent before its end padding.
        param_indices: each parameter's index among the parameters of its dtype (checkpoint loading of FP8
            parameters); in ``param_index_map``'s order.
        num_optimizer_shards: the number of distributed-optimizer shards the layout was padded for
            (``None`` for a layout without a distributed optimizer).
    """

    param_index_map: dict[torch.nn.Parameter, tuple[int, int, int]] = field(default_factory=dict)
    bucket_indices: list[tuple[int, int]] = field(default_factory=list)
    per_bucket_numel_unpadded: list[int] = field(default_factory=list)
    param_indices: list[int] = field(default_factory=list)
    num_optimizer_shards: int | None = None


@dataclass
class FullParamLayout:
    """The layouts of all buffers of a model chunk, each in its own index space."""

    layouts: dict[BufferKey, PerBufferParamLayout] = field(default_factory=dict)


def compute_per_buffer_param_layout(params: list[torch.nn.Parameter], bucket_size: int | None,
                                     data_parallel_world_size: int, ddp_config: Any,
                                     param_indices: list[int] | None = None) -> PerBufferParamLayout:
    """The padded layout of one buffer: params in reverse order, each starting on a 64-element boundary.

    A bucket is closed once it spans at least ``bucket_size`` elements (``None``: one bucket) and its
    end is padded by :func:`pad_bucket_end` so that it splits into
    ``data_parallel_world_size`` equal shards. A ``shared_embedding`` parameter (a tied embedding,
    all-reduced across pipeline stages) gets a bucket of its own.
    """
    layout = PerBufferParamLayout(param_indices=list(param_indices) if param_indices is not None else [],
                                  num_optimizer_shards=data_parallel_world_size)
    pad_busbw = ddp_config.pad_buckets_for_high_nccl_busbw
    bucket_start = index = end = 0
    open_bucket = False

    def close_bucket(bucket_end: int) -> int:
        layout.per_bucket_numel_unpadded.append(bucket_end - bucket_start)
        padded = pad_bucket_end(bucket_end, data_parallel_world_size, pad_busbw)
        layout.bucket_indices.append((bucket_start, padded))
        return padded

    for param in params[::-1]:
        index = pad_param_start(index)
        shared = bool(getattr(param, "shared_embedding", False))
        if shared and open_bucket:
            bucket_start = index = close_bucket(index)
        end = index + param.data.nelement()
        layout.param_index_map[param] = (index, end, len(layout.bucket_indices))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            bucket_start = index = close_bucket(end)
            open_bucket = False
        else:
            index = end
    if open_bucket:
        close_bucket(end)
    return layout


def compute_nvfp4_packed_layout(layout: PerBufferParamLayout, params: Sequence[torch.nn.Parameter],
                                nvfp4_params: Collection[torch.nn.Parameter],
                                pad_for_data_parallel_world_size: int | None = None,
                                pad_for_high_nccl_busbw: bool = False) -> PerBufferParamLayout:
    """The parameter-buffer layout of a buffer holding NVFP4 parameters, derived from its (gradient) ``layout``.

    An NVFP4 parameter's bytes pack two values each, so in the parameter buffer it spans half its element
    count while its gradient keeps the full count: the buffer keeps ``layout`` for gradients and this packed
    layout for parameters. Every other parameter spans its full count in both. Parameters are placed in
    ``layout``'s order (``params`` reversed) and keep their bucket; with ``pad_for_data_parallel_world_size``
    (a distributed optimizer) each start is aligned to 64 elements and each bucket end padded by
    :func:`pad_bucket_end`, as in :func:`compute_per_buffer_param_layout`. A bucket closes where the next
    bucket's first parameter would start (after its alignment), so its unpadded extent counts that alignment,
    as Megatron-Core's does. ``ValueError`` for an NVFP4 parameter of odd element count.
    """
    dp = pad_for_data_parallel_world_size
    packed = PerBufferParamLayout(param_indices=list(layout.param_indices), num_optimizer_shards=dp)

    def close_bucket(bucket_start: int, bucket_end: int) -> int:
        packed.per_bucket_numel_unpadded.append(bucket_end - bucket_start)
        padded = bucket_end if dp is None else pad_bucket_end(bucket_end, dp, pad_for_high_nccl_busbw)
        packed.bucket_indices.append((bucket_start, padded))
        return padded

    nvfp4 = {id(p) for p in nvfp4_params}
    bucket_start = index = 0
    bucket_id = 0
    for param in params[::-1]:
        index = index if dp is None else pad_param_start(index)
        param_bucket = layout.param_index_map[param][2]
        if param_bucket != bucket_id:
            bucket_start = index = close_bucket(bucket_start, index)
            bucket_id = param_bucket
        numel = param.data.nelement()
        if id(param) in nvfp4:
            if numel % 2:
                raise ValueError(f"an NVFP4 parameter of shape {tuple(param.data.shape)} has an odd element count "
                                 f"({numel}): NVFP4 packs two values per byte")
            numel //= 2
        packed.param_index_map[param] = (index, index + numel, param_bucket)
        index += numel
    if index > bucket_start:
        close_bucket(bucket_start, index)
    if len(packed.bucket_indices) != len(layout.bucket_indices):
        raise ValueError(f"the packed NVFP4 layout has {len(packed.bucket_indices)} buckets, the gradient layout "
                         f"{len(layout.bucket_indices)}: every bucket must hold at least one parameter")
    return packed


__all__ = [
    "BufferKey",
    "FullParamLayout",
    "PerBufferParamLayout",
    "bucket_end_divisor",
    "compute_nvfp4_packed_layout",
    "compute_per_buffer_param_layout",
    "pad_bucket_end",
    "pad_param_start",
    "pad_to_divisor",
]
