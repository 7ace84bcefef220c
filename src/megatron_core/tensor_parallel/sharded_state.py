"""``sharded_state_dict`` for the tensor-parallel layers: how their shards map into a global checkpoint.

A parameter split over TP along ``axis`` becomes a ``ShardedTensor`` cut into TP pieces along
that axis (``replica_id = (0, 0, dp_rank)``); a replicated parameter is one shard with
``replica_id = (0, tp_rank, dp_rank)``, so only TP rank 0 of DP rank 0 writes it. ``sharded_offsets``
are extra leading axes prepended by the caller (e.g. the layer index of a stacked block).
``dist_checkpointing`` sits below ``tensor_parallel``: it knows no layer, layers describe themselves.
"""

from __future__ import annotations

import torch

from megatron_core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.utils import get_pg_rank, get_pg_size

_EXTRA_STATE_SUFFIX = "_extra_state"


def _extra_state_grid(sharded_offsets: tuple) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Grid shape and offset of a per-layer object placed along the prepended axes."""
    if not sharded_offsets:
        return (1,), (0,)
    ordered = sorted(sharded_offsets, key=lambda offset: offset[0])
    axes = [axis for axis, _, _ in ordered]
    if axes != list(range(len(axes))):
        raise ValueError(f"sharded_offsets must cover the leading axes 0..n-1 in order, got axes {axes}")
    return tuple(size for _, _, size in ordered), tuple(offset for _, offset, _ in ordered)


def make_tp_sharded_state_dict(module: torch.nn.Module, prefix: str, tp_axis_map: dict[str, int],
                               sharded_offsets: tuple = (), allow_shape_mismatch: tuple[str, ...] = ()) -> dict:
    """``{prefix + name: ShardedTensor | ShardedObject}`` for every entry of ``module.state_dict()``.

    ``tp_axis_map`` names the entries split over TP and their axis; every other tensor is replicated.
    Entries in ``allow_shape_mismatch`` may load into a differently padded shape (vocabulary rows).
    """
    tp_group = module.tp_group
    tp_rank, tp_size = get_pg_rank(tp_group), get_pg_size(tp_group)
    dp_rank = get_pg_rank(resolve_process_group("dp_cp"))
    prepend_axis_num = len(sharded_offsets)
    sharded = {}
    for name, tensor in module.state_dict(prefix="", keep_vars=True).items():
        key = f"{prefix}{name}"
        if name.endswith(_EXTRA_STATE_SUFFIX):
            shape, offset = _extra_state_grid(sharded_offsets)
            sharded[key] = ShardedObject(key, tensor, shape, offset, replica_id=(0, tp_rank, dp_rank))
        elif name in tp_axis_map:
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, (tp_axis_map[name] + prepend_axis_num, tp_rank, tp_size),
                replica_id=(0, 0, dp_rank), prepend_axis_num=prepend_axis_num,
                allow_shape_mismatch=name in allow_shape_mismatch,
            )
        else:
            sharded[key] = ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, replica_id=(0, tp_rank, dp_rank), prepend_axis_num=prepend_axis_num,
            )
    return sharded
