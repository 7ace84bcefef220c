"""Describe one tensor for the resharding planner: sharding attributes, group ranks and a canonical name.

The canonical ``resolved_name`` lets a destination tensor find its source across layouts: pipeline stages
name their layers locally (``decoder.layers.0`` on stage 1 is global layer ``N``), so the layer index is
rewritten from each layer's global ``layer_number``; per-expert tensors (``weightK`` / ``biasK``, ``local_experts.K``) get the
global expert index under expert parallelism.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.resharding._records import ParameterMetadata

_EXPERT_PARAM = re.compile(r"^(weight|bias)(\d+)$")


def _expert_index_in_name(name: str) -> int | None:
    """The local expert index in ``...weightK`` / ``...biasK`` or ``...local_experts.K...`` names."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        match = _EXPERT_PARAM.match(part)
        if match:
            return int(match.group(2))
        if part == "local_experts" and i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _with_expert_index(name: str, index: int) -> str:
    parts = name.split(".")
    for i, part in enumerate(parts):
        match = _EXPERT_PARAM.match(part)
        if match:
            parts[i] = f"{match.group(1)}{index}"
        elif part == "local_experts" and i + 1 < len(parts) and parts[i + 1].isdigit():
            parts[i + 1] = str(index)
    return ".".join(parts)


def build_layer_prefix_map(module: torch.nn.Module) -> dict[str, str]:
    """``{local layer path: global layer path}`` from each numbered submodule's 1-based ``layer_number``."""
    out: dict[str, str] = {}
    for path, sub in module.named_modules():
        number = getattr(sub, "layer_number", None)
        parts = path.split(".") if path else []
        if not isinstance(number, int) or not parts or not parts[-1].isdigit():
            continue
        out[path] = ".".join(parts[:-1] + [str(number - 1)])
    return out


def _global_layer_name(name: str, prefix_map: Mapping[str, str]) -> str:
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = prefix_map.get(".".join(parts[:cut]))
        if mapped is not None:
            return ".".join([mapped, *parts[cut:]])
    return name


def assign_ep_resolved_name_inplace(meta: ParameterMetadata, *, base_name: str | None = None) -> None:
    """Set ``meta.resolved_name`` (and ``global_expert_index``) with per-expert indices made global under EP."""
    base = meta.name if base_name is None else base_name
    meta.resolved_name, meta.global_expert_index = base, None
    if not meta.is_ep:
        return
    local = _expert_index_in_name(base)
    if local is None or not meta.expert_parallel_group_ranks or not meta.num_experts:
        return  # a stacked expert tensor: sharded along dim 0 over EP, matched by its plain name
    ep_ranks = meta.expert_parallel_group_ranks
    per_rank = meta.num_experts // len(ep_ranks)
    global_idx = ep_ranks.index(meta.owner_rank) * per_rank + local
    meta.global_expert_index = global_idx
    meta.resolved_name = _with_expert_index(base, global_idx)


def assign_resolved_name_inplace(meta: ParameterMetadata, *, layer_module_prefix_map: Mapping[str, str] | None = None,
                                 base_name: str | None = None) -> None:
    """Set ``meta.resolved_name``: global layer indices (from ``layer_module_prefix_map``), then global experts."""
    name = meta.name if base_name is None else base_name
    if layer_module_prefix_map:
        name = _global_layer_name(name, layer_module_prefix_map)
    assign_ep_resolved_name_inplace(meta, base_name=name)


def _group_ranks(group: Any, owner_rank: int, offset: int) -> list[int]:
    """Ranks of ``group`` shifted by ``offset``; a missing group is this rank alone (size 1)."""
    if group is None:
        return [owner_rank]
    return [r + offset for r in dist.get_process_group_ranks(group)]


def extract_param_metadata(param: torch.Tensor, param_name: str, owner_rank: int, pg_collection: Any,
                           num_experts: int | None = None, layer_module_prefix_map: Mapping[str, str] | None = None,
                           rank_offset: int = 0, _rank_list_cache: dict | None = None) -> ParameterMetadata:
    """The :class:`ParameterMetadata` of ``param`` held by ``owner_rank`` in a model using ``pg_collection``.

    TP sharding comes from the ``tensor_model_parallel`` / ``partition_dim`` / ``partition_stride`` (and
    optional ``partition_sizes``) attributes; expert tensors are the ones marked ``allreduce = False`` and use
    the expert TP group (``expt_tp``, else ``tp``) and the EP group. Group ranks are shifted by ``rank_offset``.
    """
    cache = {} if _rank_list_cache is None else _rank_list_cache

    def ranks(group: Any) -> list[int]:
        key = tuple(_group_ranks(group, owner_rank, rank_offset))
        return cache.setdefault(key, list(key))

    is_tp = bool(getattr(param, "tensor_model_parallel", False))
    sizes = getattr(param, "partition_sizes", None)
    is_ep = not bool(getattr(param, "allreduce", True))
    per_expert = num_experts is not None and _expert_index_in_name(param_name) is not None
    pg = pg_collection
    ep_ranks = None
    if is_ep or per_expert:
        if is_ep:
            ep_ranks = ranks(getattr(pg, "ep", None))
        expt_tp = getattr(pg, "expt_tp", None)
        tp_ranks = ranks(expt_tp if expt_tp is not None else getattr(pg, "tp", None))
    else:
        tp_ranks = ranks(getattr(pg, "tp", None))
    meta = ParameterMetadata(
        name=param_name, shape=tuple(param.shape), dtype=param.dtype, element_size=param.element_size(),
        is_tp=is_tp, partition_dim=int(getattr(param, "partition_dim", 0)),
        partition_stride=int(getattr(param, "partition_stride", 1)),
        partition_sizes=list(sizes) if sizes is not None else None, is_ep=is_ep, num_experts=num_experts,
        owner_rank=owner_rank, tensor_parallel_group_ranks=tp_ranks, expert_parallel_group_ranks=ep_ranks,
        data_parallel_group_ranks=ranks(getattr(pg, "dp", None)),
        pipeline_parallel_group_ranks=ranks(getattr(pg, "pp", None)),
    )
    assign_resolved_name_inplace(meta, layer_module_prefix_map=layer_module_prefix_map, base_name=param_name)
    return meta
