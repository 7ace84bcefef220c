"""Reduce-scatter that sums in fp32 (Megatron-Core ``reduce_scatter_with_fp32_accumulation``).

A plain reduce-scatter of bf16 gradients adds them in bf16, rounding after every partial sum. Here
each rank first receives every rank's copy of its own shard, still in the low precision, with one
``all_to_all``, then adds the ``world_size`` copies locally in fp32 and rounds once into ``output``.
The traffic is that of a reduce-scatter; the extra cost is one input-sized receive buffer.

Megatron-Core supports only ``SUM``; ``AVG`` is also accepted here (divided in fp32 before rounding).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground import get_pg_size


class _ReduceScatterWithFP32AccumulationWorkHandle:
    """What an ``async_op`` call returns: ``wait()`` finishes the exchange and writes the fp32 sum."""

    def __init__(self, all_to_all_handle: Any, all_to_all_output_tensor: torch.Tensor, output_tensor: torch.Tensor,
                 world_size: int, average: bool) -> None:
        self.all_to_all_handle = all_to_all_handle
        self.all_to_all_output_tensor = all_to_all_output_tensor
        self.output_tensor = output_tensor
        self.world_size = world_size
        self.average = average

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the exchange (at most ``timeout`` if given), add the copies of this rank's shard in fp32 and
        round into the output."""
        if self.all_to_all_handle is not None:
            if timeout is None:
                self.all_to_all_handle.wait()
            else:
                self.all_to_all_handle.wait(timeout)
        total = torch.sum(self.all_to_all_output_tensor.view(self.world_size, -1), dim=0, dtype=torch.float32)
        if self.average:
            total /= self.world_size
        self.output_tensor.view(-1).copy_(total)
        return True


def reduce_scatter_with_fp32_accumulation(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                                          op: dist.ReduceOp, group: Any,
                                          async_op: bool) -> _ReduceScatterWithFP32AccumulationWorkHandle | None:
    """Reduce-scatter ``input_tensor`` over ``group`` into ``output_tensor`` (this rank's shard), summing in fp32.

    ``input_tensor`` holds ``world_size`` equal shards in rank order; ``output_tensor`` (which may be a
    view of ``input_tensor``) receives the sum of this rank's shard over all ranks, computed in fp32.
    ``group`` None is the world. ``op``: ``ReduceOp.SUM`` or ``ReduceOp.AVG``. With ``async_op`` a handle is returned whose ``wait()``
    completes the exchange and the sum; otherwise it is done on return (None).
    """
    if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
        raise ValueError(f"reduce_scatter_with_fp32_accumulation supports ReduceOp.SUM and ReduceOp.AVG, got {op}")
    if group is None:  # torch.distributed's WORLD, as in Megatron-Core
        world_size = dist.get_world_size() if dist.is_initialized() else 1
    else:
        world_size = get_pg_size(group)
    if input_tensor.numel() % world_size:
        raise ValueError(f"reduce_scatter_with_fp32_accumulation: input_tensor numel ({input_tensor.numel()}) "
                         f"must be divisible by the group size ({world_size})")
    if output_tensor.numel() * world_size != input_tensor.numel():
        raise ValueError(f"reduce_scatter_with_fp32_accumulation: output_tensor numel ({output_tensor.numel()}) must "
                         f"be input_tensor numel ({input_tensor.numel()}) / group size ({world_size})")
    received = torch.empty_like(input_tensor)
    work = None
    if world_size == 1:
        received.copy_(input_tensor)
    else:
        work = dist.all_to_all_single(received, input_tensor.contiguous(), group=group, async_op=async_op)
    handle = _ReduceScatterWithFP32AccumulationWorkHandle(work, received, output_tensor, world_size,
                                                          average=op == dist.ReduceOp.AVG)
    if async_op:
        return handle
    handle.wait()
    return None
