"""Which source slices make up a destination shard, along one sharded dimension and for a whole tensor.

Along one dimension the full length is cut into ``lcm(src_world * src_stride, dst_world * dst_stride)``
equal units; a strided layout (``stride`` > 1, e.g. SwiGLU's ``[gate; up]`` per shard) gives rank ``r``
segments ``r, r + world, ...`` of the ``world * stride`` segments. Each unit of a destination shard then
comes from exactly one source shard; adjacent units from the same source are merged.
"""

from __future__ import annotations

import itertools
import math

from megatron_core.resharding._records import ParameterMetadata


class ReshardPlanError(ValueError, RuntimeError):
    """The source and destination layouts of a tensor cannot be matched (names the tensor and shapes)."""


# One tile: (source shard index, start in the source shard, start in the destination shard, length).
Tile = tuple[int, int, int, int]


def dim_tiles(name: str, full_len: int, src_world: int, src_stride: int, dst_world: int, dst_stride: int,
              dst_index: int, src_offset: int = 0, dst_offset: int = 0) -> list[Tile]:
    """The tiles of destination shard ``dst_index`` along one dimension of length ``full_len``."""
    n_src, n_dst = src_world * src_stride, dst_world * dst_stride
    units = math.lcm(n_src, n_dst)
    if full_len % units:
        raise ReshardPlanError(
            f"{name}: sharded length {full_len} is not divisible by lcm({src_world}x{src_stride} source, "
            f"{dst_world}x{dst_stride} destination segments) = {units}")
    unit = full_len // units
    per_src, per_dst = units // n_src, units // n_dst
    tiles: list[Tile] = []
    for k in range(dst_stride):
        seg = dst_index + k * dst_world
        for off in range(per_dst):
            micro = seg * per_dst + off
            src_seg, in_seg = divmod(micro, per_src)
            src_local_seg, src_idx = divmod(src_seg, src_world)
            src_start = src_offset + (src_local_seg * per_src + in_seg) * unit
            dst_start = dst_offset + (k * per_dst + off) * unit
            last = tiles[-1] if tiles else None
            if last and last[0] == src_idx and last[1] + last[3] == src_start and last[2] + last[3] == dst_start:
                tiles[-1] = (src_idx, last[1], last[2], last[3] + unit)
            else:
                tiles.append((src_idx, src_start, dst_start, unit))
    return tiles


def tp_tiles(name: str, src: ParameterMetadata, dst: ParameterMetadata, dim: int, src_world: int,
             dst_world: int, dst_index: int) -> list[Tile]:
    """Tiles along the TP dimension, block by block when a side packs blocks (``partition_sizes``)."""
    src_sizes, dst_sizes = src.partition_sizes, dst.partition_sizes
    src_stride = src.partition_stride if src.is_tp else 1
    dst_stride = dst.partition_stride if dst.is_tp else 1
    if src_sizes is None and dst_sizes is None:
        return dim_tiles(name, dst.shape[dim] * dst_world, src_world, max(1, src_stride), dst_world,
                         max(1, dst_stride), dst_index)
    full = [s * src_world for s in src_sizes] if src_sizes is not None else [s * dst_world for s in dst_sizes]
    src_sizes = src_sizes if src_sizes is not None else [f // src_world for f in full]
    dst_sizes = dst_sizes if dst_sizes is not None else [f // dst_world for f in full]
    if len(src_sizes) != len(dst_sizes) or any(s * src_world != d * dst_world for s, d in zip(src_sizes, dst_sizes)):
        raise ReshardPlanError(f"{name}: packed blocks differ: source {src_sizes} x {src_world} ranks, "
                               f"destination {dst_sizes} x {dst_world} ranks")
    tiles: list[Tile] = []
    src_off = dst_off = 0
    for block, (s, d) in enumerate(zip(src_sizes, dst_sizes)):
        tiles += dim_tiles(f"{name} block {block}", s * src_world, src_world, 1, dst_world, 1, dst_index,
                           src_off, dst_off)
        src_off, dst_off = src_off + s, dst_off + d
    return tiles


def combine(ndim: int, dims: list[int], per_dim: list[list[Tile]]) -> list[tuple[tuple[int, ...], tuple, tuple]]:
    """Cross the tiles of every sharded dim: ``(source shard coordinates, source slice, destination slice)``."""
    out = []
    for combo in itertools.product(*per_dim):
        src_slice, dst_slice = [slice(None)] * ndim, [slice(None)] * ndim
        for dim, (_idx, s0, d0, length) in zip(dims, combo):
            src_slice[dim] = slice(s0, s0 + length)
            dst_slice[dim] = slice(d0, d0 + length)
        out.append((tuple(t[0] for t in combo), tuple(src_slice), tuple(dst_slice)))
    return out
