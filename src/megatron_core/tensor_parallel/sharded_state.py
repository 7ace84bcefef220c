"""``sharded_state_dict`` for the tensor-parallel layers: how their shards map into a global checkpoint.

A parameter split over TP along ``axis`` becomes a ``ShardedTensor`` cut into TP pieces along
that axis (``replica_id = (0, 0, dp_rank)``); a replicated parameter is one shard with
``replica_id = (0, tp_rank, dp_rank)``, so only TP rank 0 of DP rank 0 writes it (ranks in the layer's
``tp_group`` and the metadata's ``dp_cp_group``). ``sharded_offsets``
are extra leading axes prepended by the caller (e.g. the layer index of a stacked block).
``dist_checkpointing`` sits below ``tensor_parallel``: it knows no layer, layers describe themselves
through its :func:`~megatron_core.dist_checkpointing.sharded_module.make_sharded_tensors_for_checkpoint`.
"""

from __future__ import annotations

import dataclasses

import torch

from megatron_core.dist_checkpointing.sharded_module import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
)


def make_tp_sharded_state_dict(module: torch.nn.Module, prefix: str, tp_axis_map: dict[str, int],
                               sharded_offsets: tuple = (), allow_shape_mismatch: tuple[str, ...] = (),
                               metadata: dict | None = None) -> dict:
    """``{prefix + name: ShardedTensor | ShardedObject}`` for every entry of ``module.state_dict()``.

    ``tp_axis_map`` names the entries split over ``module.tp_group`` and their axis; every other tensor is
    replicated. DP replicas are counted in ``metadata["dp_cp_group"]`` (``parallel_state``'s when absent).
    Entries in ``allow_shape_mismatch`` may load into a differently padded shape (vocabulary rows).
    """
    state = module.state_dict(prefix="", keep_vars=True)
    dp_cp_group = ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"]
    sharded = make_sharded_tensors_for_checkpoint(state, prefix, tp_axis_map, sharded_offsets,
                                                  tp_group=module.tp_group, dp_cp_group=dp_cp_group)
    for name in allow_shape_mismatch:
        key = f"{prefix}{name}"
        if key in sharded:
            sharded[key] = dataclasses.replace(sharded[key], allow_shape_mismatch=True)
    return sharded
