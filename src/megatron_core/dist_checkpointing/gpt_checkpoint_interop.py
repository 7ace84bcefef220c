"""Loading a GPTModel checkpoint into a hybrid (Mamba) model (Megatron-Core ``gpt_checkpoint_interop``).

A GPT layer holds self-attention and an MLP; a hybrid model gives each its own layer (``*`` and
``-``/``E`` in the hybrid layer pattern), while Mamba (``M``) layers have no GPT counterpart. The
checkpoint stays as it is: the hybrid model's *sharded state dict* is pointed at the GPT storage
keys before ``dist_checkpointing.load``. The i-th attention layer and the i-th MLP layer take GPT
layer i, whose tensors GPT stores stacked (``decoder.layers.<name>`` with a leading layer axis);
``decoder.final_norm`` reads ``decoder.final_layernorm``; Mamba layers become
``LocalNonpersistentObject`` s and keep their current values. Optimizer states stored in model space
(``optimizer.state.<name>.<model key>``) are retargeted the same way. Loading then reshards over
any TP/PP layout as usual. :func:`retarget_fsdp_state_dict_to_gpt_checkpoint` does the same for
plain per-parameter state dicts (FSDP ``DTensor`` state saved with ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from megatron_core._ground.hybrid_pattern import (
    get_layer_maps_from_layer_type_list,
    parse_hybrid_pattern,
)
from megatron_core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron_core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
)

__all__ = [
    "GPTCompatLayerMaps",
    "gpt_compatible_layer_maps",
    "retarget_fsdp_state_dict_to_gpt_checkpoint",
    "retarget_sharded_state_dict_to_gpt_checkpoint",
]

_ATTENTION, _MLP, _MOE, _MAMBA, _PIPE = "*", "-", "E", "M", "|"
_LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.")
_FINAL_NORM = ("decoder.final_norm.", "decoder.final_layernorm.")
_LOCAL_ONLY_SUFFIXES = ("output_layer._extra_state",)  # GPT checkpoints do not store these keys


@dataclass(frozen=True)
class GPTCompatLayerMaps:
    """Which GPT layer feeds each hybrid layer.

    ``attention_to_gpt`` / ``mlp_to_gpt``: global hybrid layer index -> GPT layer index (the i-th
    attention and the i-th MLP layer both map to GPT layer i). ``fresh_init``: hybrid layers (Mamba)
    that keep their own values. ``num_gpt_layers``: the GPT checkpoint's layer count.
    """

    attention_to_gpt: Mapping[int, int]
    mlp_to_gpt: Mapping[int, int]
    fresh_init: frozenset
    num_gpt_layers: int


def gpt_compatible_layer_maps(hybrid_layer_pattern: str) -> GPTCompatLayerMaps:
    """Pair the layers of ``hybrid_layer_pattern`` (``|`` allowed) with the layers of a GPT checkpoint.

    Raises ValueError for patterns a GPT checkpoint cannot feed: MTP depths (``/``), layer kinds
    other than ``M``, ``*``, ``-``, ``E``, dense and MoE MLPs mixed, or attention and MLP counts
    that differ (or are zero).
    """
    parsed = parse_hybrid_pattern(hybrid_layer_pattern)
    if parsed.mtp_num_depths > 0:
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r} has multi-token-prediction depths "
                         f"('/{parsed.mtp_pattern}'), which a GPT checkpoint has no weights for; drop the MTP part")
    layers = list((parsed.main_pattern or "").replace(_PIPE, ""))
    if not layers:
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r} has no layers")
    allowed = {_ATTENTION, _MLP, _MOE, _MAMBA}
    other = sorted(set(layers) - allowed)
    if other:
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r} has layer kinds {other} that cannot be "
                         f"loaded from a GPT checkpoint; allowed are {sorted(allowed)} ('M' keeps its own values)")
    maps = get_layer_maps_from_layer_type_list(layers)
    if maps[_MLP] and maps[_MOE]:
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r} mixes dense ('-') and MoE ('E') MLP "
                         "layers; a GPT checkpoint has one MLP kind in every layer, so use only one of them")
    mlp = maps[_MOE] or maps[_MLP]
    attention = maps[_ATTENTION]
    if not attention or len(attention) != len(mlp):
        raise ValueError(f"hybrid_layer_pattern {hybrid_layer_pattern!r} has {len(attention)} attention ('*') and "
                         f"{len(mlp)} MLP ('-'/'E') layers; each GPT layer feeds one of each, so the counts "
                         "must be equal and nonzero")
    return GPTCompatLayerMaps(dict(attention), dict(mlp), frozenset(maps[_MAMBA]), len(attention))


def _gpt_layer(layer_maps: GPTCompatLayerMaps, hybrid_idx: int, where: str) -> int | None:
    """GPT layer index of hybrid layer ``hybrid_idx``; None for a fresh layer; ValueError if unknown."""
    if hybrid_idx in layer_maps.fresh_init:
        return None
    for mapping in (layer_maps.attention_to_gpt, layer_maps.mlp_to_gpt):
        if hybrid_idx in mapping:
            return mapping[hybrid_idx]
    raise ValueError(f"{where} belongs to hybrid layer {hybrid_idx}, which the GPT layer maps do not "
                     "contain: the maps were derived from a different hybrid layer pattern than the model's")


def _add_layer_axis(entry: Any, gpt_idx: int, num_layers: int) -> Any:
    """Give ``entry`` GPT's stacked-layer axis (leading, size ``num_layers``, at ``gpt_idx``)."""
    if isinstance(entry, ShardedTensor):
        entry.global_shape = (num_layers, *entry.global_shape)
        entry.global_offset = (gpt_idx, *entry.global_offset)
        if entry.axis_fragmentations is not None:
            entry.axis_fragmentations = (num_layers, *entry.axis_fragmentations)
        entry.prepend_axis_num += 1
        entry.validate_metadata_integrity()
    elif isinstance(entry, ShardedObject):
        if entry.global_shape == (1,) and entry.global_offset == (0,):  # a lone object: the layer is its grid
            entry.global_shape, entry.global_offset = (num_layers,), (gpt_idx,)
        else:
            entry.global_shape = (num_layers, *entry.global_shape)
            entry.global_offset = (gpt_idx, *entry.global_offset)
        entry.validate_metadata_integrity()
    elif isinstance(entry, ShardedTensorFactory):
        build = entry.build_fn

        def build_with_layer_axis(key: str, data: Any, replica_id: Any, flattened_range: Any) -> Any:
            built = build(key, data, replica_id, flattened_range)
            if isinstance(built, (dict, list)):
                return dict_list_map_inplace(lambda sub: _add_layer_axis(sub, gpt_idx, num_layers), built)
            return _add_layer_axis(built, gpt_idx, num_layers)

        entry.build_fn = build_with_layer_axis
    return entry


def _rename_final_norm(key: str) -> str:
    old, new = _FINAL_NORM
    pos = key.find(old)
    return key if pos < 0 else f"{key[:pos]}{new}{key[pos + len(old):]}"


def retarget_sharded_state_dict_to_gpt_checkpoint(sharded_state_dict: ShardedStateDict,
                                                  layer_maps: GPTCompatLayerMaps) -> None:
    """Point a hybrid model's (or its model-space optimizer's) sharded state dict at a GPT checkpoint.

    In place; only the storage side of each sharded entry (``key``, global shape and offset) changes,
    the nested dict keys stay the model's, so the loaded result feeds ``model.load_state_dict``.
    Attention/MLP entries of hybrid layer ``g`` read GPT layer ``layer_maps`` gives for ``g``;
    Mamba layers and ``output_layer._extra_state`` become ``LocalNonpersistentObject`` (kept as is).
    """

    def retarget(entry: Any) -> Any:
        if not isinstance(entry, ShardedBase):
            return entry
        if entry.key.endswith(_LOCAL_ONLY_SUFFIXES):
            return LocalNonpersistentObject(entry.data)
        match = _LAYER_RE.search(entry.key)
        if match is None:
            entry.key = _rename_final_norm(entry.key)
            return entry
        gpt_idx = _gpt_layer(layer_maps, int(match.group(1)), f"sharded entry {entry.key!r}")
        if gpt_idx is None:
            return LocalNonpersistentObject(entry.data)
        entry.key = f"{entry.key[:match.start()]}decoder.layers.{entry.key[match.end():]}"
        return _add_layer_axis(entry, gpt_idx, layer_maps.num_gpt_layers)

    dict_list_map_inplace(retarget, sharded_state_dict)


def _retarget_name(key: Any, layer_maps: GPTCompatLayerMaps, checkpoint_keys: set[str] | None) -> Any:
    """The GPT name of one explicit (per-layer) state dict key; None to leave the entry out."""
    if not isinstance(key, str):
        return key
    if key.endswith(_LOCAL_ONLY_SUFFIXES):
        return None
    match = _LAYER_RE.search(key)
    if match is not None:
        gpt_idx = _gpt_layer(layer_maps, int(match.group(1)), f"state dict entry {key!r}")
        if gpt_idx is None:
            return None
        key = f"{key[:match.start()]}decoder.layers.{gpt_idx}.{key[match.end():]}"
    key = _rename_final_norm(key)
    if checkpoint_keys is not None:
        # Wrappers may add ``module.`` levels on either side: adopt the checkpoint's spelling if unique.
        bare = re.sub(r"^(?:module\.)+", "", key)
        pattern = re.compile(rf"(?<![A-Za-z0-9_])((?:module\.)*{re.escape(bare)})(?:\.|$)")
        found = {m.group(1) for k in checkpoint_keys if (m := pattern.search(k)) is not None}
        if len(found) == 1:
            key = found.pop()
    return key


def retarget_fsdp_state_dict_to_gpt_checkpoint(state_dict: Mapping[Any, Any], layer_maps: GPTCompatLayerMaps,
                                               checkpoint_keys: Iterable[str] | None = None,
                                               checkpoint_prefix: str = "") -> dict[Any, Any]:
    """A copy of a per-parameter state dict (FSDP ``DTensor`` model or optimizer state) under GPT names.

    Every string key naming a hybrid layer is renamed to its GPT layer (``decoder.layers.<gpt i>.``,
    ``decoder.final_layernorm.``), recursively through nested dicts, lists and tuples; entries of
    Mamba layers and ``output_layer._extra_state`` are left out (they keep their values when loaded
    with ``torch.distributed.checkpoint.load``). The leaves are the same objects, so loading into the
    copy fills the model in place. With ``checkpoint_keys`` (the flattened names in the checkpoint's
    metadata, e.g. ``model.decoder.layers.0...``) ``module.`` prefixes follow the checkpoint's, and
    leaves whose ``<checkpoint_prefix>.<path>`` the checkpoint does not hold are left out.
    """
    known = set(checkpoint_keys) if checkpoint_keys is not None else None

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            out = {}
            for key, child in value.items():
                new_key = _retarget_name(key, layer_maps, known)
                if new_key is None:
                    continue
                child_path = f"{path}.{new_key}" if path else str(new_key)
                if known is None or isinstance(child, (Mapping, list, tuple)) or child_path in known:
                    out[new_key] = walk(child, child_path)
            return out
        if isinstance(value, (list, tuple)):
            items = [walk(child, f"{path}.{i}") for i, child in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return walk(state_dict, checkpoint_prefix)
