"""Building a module's sharded state dict from its parameters (Megatron-Core's ``make_sharded_tensor*``).

Megatron-Core keeps these helpers in ``transformer/utils.py`` and ``dist_checkpointing/utils.py``;
they live here so that any module can use them. Replica ids follow Megatron-Core: a tuple
``(pp_replica, tp_replica, dp_rank)``. A TP-sharded tensor is ``(0, 0, dp_rank)`` (each TP rank
holds a distinct piece); a TP-replicated one is ``(0, tp_rank, dp_rank)``, so only TP rank 0 of
DP rank 0 writes it. ``sharded_offsets`` are ``(axis, index, size)`` triples for leading global
axes that do not exist locally, e.g. ``(0, global_layer_idx, num_layers)`` added by
``TransformerBlock`` so every layer's weights form one stacked tensor and pipeline stages can
be resharded.

Which groups give the ranks (as Megatron-Core 0.19): the TP rank and size come from the module's
own ``tp_group`` (a plain child such as a norm inherits its parent's), the DP replica index from
``metadata["dp_cp_group"]``, which a model with its own process groups puts there (``MimoModel``
does for each module); :func:`_checkpoint_ranks` is the one place that turns them into ranks.
A group that is not given falls back to ``parallel_state``'s. Megatron-Core falls back only when
both are missing and otherwise reads a missing group as rank 0, which would make every DP (or TP)
rank a main replica; this package falls back per group instead.

:func:`sharded_state_dict_default` describes a module from parameter attributes alone
(``tensor_model_parallel`` and ``partition_dim``, set by the tensor-parallel layers), and asks
each child with a ``sharded_state_dict`` method to describe itself. It knows no model: rules of
a particular module (a gated MLP's fc1 layout, a tied output layer) live in that module's own
``sharded_state_dict`` (``MLP``, ``LanguageModule``), which calls these helpers.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.dist_checkpointing.mapping import ReplicaId, ShardedObject, ShardedStateDict, ShardedTensor
from megatron_core.dist_checkpointing.utils import replace_prefix_for_sharding
from megatron_core.process_groups_config import resolve_process_group

EXTRA_STATE_SUFFIX = "_extra_state"


def _checkpoint_ranks(tp_group: Any = None, dp_cp_group: Any = None) -> tuple[int, int, int]:
    """``(tp_rank, tp_size, dp_replica)`` in the given groups; a missing group is ``parallel_state``'s."""
    tp = resolve_process_group("tp", group=tp_group)
    dp_cp = resolve_process_group("dp_cp", group=dp_cp_group)
    return get_pg_rank(tp), get_pg_size(tp), get_pg_rank(dp_cp)


def ensure_metadata_has_dp_cp_group(metadata: dict | None) -> dict:
    """``metadata`` with a ``"dp_cp_group"`` entry: a new dict if ``None``; a dict without the entry gets
    ``parallel_state``'s DP x CP group, in place (as Megatron-Core)."""
    if metadata is None:
        return {"dp_cp_group": resolve_process_group("dp_cp")}
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict (with a 'dp_cp_group' entry), got {type(metadata).__name__}")
    if "dp_cp_group" not in metadata:
        metadata["dp_cp_group"] = resolve_process_group("dp_cp")
    return metadata


def make_sharded_tensor_for_checkpoint(tensor: torch.Tensor, key: str, prepend_offsets: tuple = (),
                                       replica_id: ReplicaId | None = None, tp_group: Any = None,
                                       dp_cp_group: Any = None, **kwargs: Any) -> ShardedTensor:
    """A tensor replicated over TP and DP (one copy written), placed by ``prepend_offsets``."""
    if replica_id is None:
        tp_rank, _, dp_replica = _checkpoint_ranks(tp_group, dp_cp_group)
        replica_id = (0, tp_rank, dp_replica)
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, replica_id=replica_id,
                                           prepend_axis_num=len(prepend_offsets), **kwargs)


def make_tp_sharded_tensor_for_checkpoint(tensor: torch.Tensor, key: str, tp_axis: int = 0,
                                          replica_id: ReplicaId | None = None, prepend_offsets: tuple = (),
                                          tp_group: Any = None, dp_cp_group: Any = None,
                                          **kwargs: Any) -> ShardedTensor:
    """A tensor split over TP along local axis ``tp_axis`` and replicated over DP."""
    tp_rank, tp_size, dp_replica = _checkpoint_ranks(tp_group, dp_cp_group)
    if replica_id is None:
        replica_id = (0, 0, dp_replica)
    prepend_axis_num = len(prepend_offsets)
    return ShardedTensor.from_rank_offsets(key, tensor, *prepend_offsets, (tp_axis + prepend_axis_num, tp_rank, tp_size),
                                           replica_id=replica_id, prepend_axis_num=prepend_axis_num, **kwargs)


def make_sharded_object_for_checkpoint(obj: Any, key: str, sharded_offsets: tuple = (),
                                       replica_id: ReplicaId | None = None, tp_group: Any = None,
                                       dp_cp_group: Any = None) -> ShardedObject:
    """A per-layer object (e.g. ``_extra_state``) placed in the grid of the prepended axes."""
    if replica_id is None:
        tp_rank, _, dp_replica = _checkpoint_ranks(tp_group, dp_cp_group)
        replica_id = (0, tp_rank, dp_replica)
    if not sharded_offsets:
        return ShardedObject(key, obj, (1,), (0,), replica_id)
    ordered = sorted(sharded_offsets)
    return ShardedObject(key, obj, tuple(s for _, _, s in ordered), tuple(i for _, i, _ in ordered), replica_id)


def make_sharded_tensors_for_checkpoint(state_dict: dict[str, Any], prefix: str,
                                        tensor_parallel_layers_axis_map: dict[str, int] | None = None,
                                        sharded_offsets: tuple = (), extra_state_suffix: str = EXTRA_STATE_SUFFIX,
                                        tp_group: Any = None, dp_cp_group: Any = None) -> ShardedStateDict:
    """Wrap a plain (local) state dict: names in ``tensor_parallel_layers_axis_map`` are TP-sharded
    along the given axis over ``tp_group``, ``*_extra_state`` entries become objects, the rest is
    replicated; every entry is replicated over ``dp_cp_group``."""
    axis_map = tensor_parallel_layers_axis_map or {}
    groups = {"tp_group": tp_group, "dp_cp_group": dp_cp_group}
    out: ShardedStateDict = {}
    for name, value in state_dict.items():
        key = f"{prefix}{name}"
        if name in axis_map:
            out[key] = make_tp_sharded_tensor_for_checkpoint(value, key, axis_map[name],
                                                            prepend_offsets=sharded_offsets, **groups)
        elif name.endswith(extra_state_suffix):
            out[key] = make_sharded_object_for_checkpoint(value, key, sharded_offsets, **groups)
        else:
            out[key] = make_sharded_tensor_for_checkpoint(value, key, sharded_offsets, **groups)
    return out


def _own_state(module: torch.nn.Module) -> dict[str, Any]:
    state: dict[str, Any] = {}
    module._save_to_state_dict(state, "", keep_vars=True)
    return state


def _module_tp_group(module: torch.nn.Module, inherited: Any) -> Any:
    """The module's ``tp_group``, else its ``pg_collection.tp``, else ``inherited`` (its parent's)."""
    own = getattr(module, "tp_group", None)
    if own is None:
        own = getattr(getattr(module, "pg_collection", None), "tp", None)
    return inherited if own is None else own


def sharded_state_dict_default(module: torch.nn.Module, prefix: str = "", sharded_offsets: tuple = (),
                               metadata: dict | None = None, tp_group: Any = None) -> ShardedStateDict:
    """Describe ``module``'s own tensors from their attributes, then ask its children.

    A tensor with ``tensor_model_parallel=True`` is split over TP along ``partition_dim``; other
    tensors are replicated. TP ranks are taken in the module's own TP group (``tp_group``, else
    ``pg_collection.tp``), else in ``tp_group`` (the caller's), else in ``parallel_state``'s; DP
    replicas in ``metadata["dp_cp_group"]`` (see the module docstring). A child that has
    ``sharded_state_dict`` describes itself; others are walked the same way and inherit the TP
    group. Unlike Megatron-Core, this never calls ``module.sharded_state_dict`` itself, so
    ``MegatronModule.sharded_state_dict`` can delegate here.
    """
    tp_group = _module_tp_group(module, tp_group)
    metadata = ensure_metadata_has_dp_cp_group(metadata)
    local = _own_state(module)
    axis_map = {
        name: int(getattr(t, "partition_dim", 0))
        for name, t in local.items()
        if isinstance(t, torch.Tensor) and getattr(t, "tensor_model_parallel", False)
    }
    out = make_sharded_tensors_for_checkpoint(local, prefix, axis_map, sharded_offsets, tp_group=tp_group,
                                              dp_cp_group=metadata["dp_cp_group"])
    for name, child in module.named_children():
        child_prefix = f"{prefix}{name}."
        if hasattr(child, "sharded_state_dict"):
            out.update(child.sharded_state_dict(prefix=child_prefix, sharded_offsets=sharded_offsets,
                                                metadata=metadata))
        else:
            out.update(sharded_state_dict_default(child, child_prefix, sharded_offsets, metadata, tp_group))
    return out


def sharded_state_dict_for_layers(layers: torch.nn.ModuleList, prefix: str, global_layer_indices: list[int],
                                  num_layers: int, sharded_offsets: tuple = (),
                                  metadata: dict | None = None, stacked: bool = True) -> ShardedStateDict:
    """Sharded state of a ``TransformerBlock``'s ``layers`` (dict keys ``<prefix><local i>.*``).

    ``stacked``: each layer's tensors get the prepended axis ``(len(sharded_offsets), global_idx, num_layers)``
    and their sharding key loses the layer index (``decoder.layers.self_attention...``). Otherwise (layers of
    different kinds, e.g. dense and MoE) each layer keeps its own keys under its global index
    (``decoder.layers.<global_idx>.``). Either way checkpoints reshard across pipeline stages.
    """
    if len(global_layer_indices) != len(layers):
        raise ValueError(f"{len(layers)} layers but {len(global_layer_indices)} global layer indices")
    out: ShardedStateDict = {}
    for local_idx, (layer, global_idx) in enumerate(zip(layers, global_layer_indices)):
        layer_prefix = f"{prefix}{local_idx}."
        offsets = (*sharded_offsets, (len(sharded_offsets), global_idx, num_layers)) if stacked else sharded_offsets
        if hasattr(layer, "sharded_state_dict"):
            layer_sd = layer.sharded_state_dict(prefix=layer_prefix, sharded_offsets=offsets, metadata=metadata)
        else:
            layer_sd = sharded_state_dict_default(layer, layer_prefix, offsets, metadata)
        replace_prefix_for_sharding(layer_sd, layer_prefix, prefix if stacked else f"{prefix}{global_idx}.")
        out.update(layer_sd)
    return out
