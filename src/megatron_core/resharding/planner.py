"""Build each rank's reshard plan from the gathered metadata of both models, with no central rank.

Every rank all-gathers ``(source metadata, destination metadata)`` of all ranks, then replays one
deterministic schedule over them (destination ranks ascending, each rank's tensors in order, each
tensor's tiles in order), numbering every transfer; it keeps the transfers it sends or receives. The
sender and the receiver of a transfer so agree on its ``task_id`` without talking to each other.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.resharding._metadata import build_layer_prefix_map, extract_param_metadata
from megatron_core.resharding._records import ParameterMetadata, ReshardPlan, ShardingDescriptor, TransferOp
from megatron_core.resharding._tiling import ReshardPlanError, combine, tp_tiles
from megatron_core.resharding._tiling import dim_tiles as _dim_tiles
from megatron_core.resharding.utils import named_refit_tensors, select_src_metadata_balanced

__all__ = [
    "build_centralized_reshard_plan",
    "build_local_reshard_plan",
    "build_plan_from_rosters",
    "index_metadata_rosters",
]

logger = logging.getLogger(__name__)

_TIED_SOURCES = ("embedding.word_embeddings.weight", "word_embeddings.weight")


def _index(ranks: list[int] | None, owner: int) -> int:
    if not ranks:
        return 0
    if owner not in ranks:
        raise ReshardPlanError(f"rank {owner} is not in its own process group {ranks}")
    return ranks.index(owner)


def _descriptors(name: str, src: ParameterMetadata, dst: ParameterMetadata) -> list[ShardingDescriptor]:
    """The sharded dimensions of a tensor: TP (either side TP-sharded) and EP for stacked expert tensors."""
    out = []
    if src.is_tp or dst.is_tp:
        if src.is_tp and dst.is_tp and src.partition_dim != dst.partition_dim:
            raise ReshardPlanError(f"{name}: source is TP-sharded on dim {src.partition_dim} but the destination "
                                   f"on dim {dst.partition_dim}")
        dim = dst.partition_dim if dst.is_tp else src.partition_dim
        out.append(ShardingDescriptor(
            "tp", dim, src.partition_stride if src.is_tp else 1, dst.partition_stride if dst.is_tp else 1,
            (src.tensor_parallel_group_ranks or [src.owner_rank]) if src.is_tp else [src.owner_rank],
            (dst.tensor_parallel_group_ranks or [dst.owner_rank]) if dst.is_tp else [dst.owner_rank]))
    if (src.is_ep or dst.is_ep) and src.global_expert_index is None and dst.global_expert_index is None:
        if out and out[0].dim == 0:
            raise ReshardPlanError(f"{name}: expert tensor is TP-sharded on dim 0, the expert dimension")
        out.append(ShardingDescriptor(
            "ep", 0, 1, 1, (src.expert_parallel_group_ranks or [src.owner_rank]) if src.is_ep else [src.owner_rank],
            (dst.expert_parallel_group_ranks or [dst.owner_rank]) if dst.is_ep else [dst.owner_rank]))
    return out


def _coords(meta: ParameterMetadata, descriptors: list[ShardingDescriptor]) -> tuple[int, ...]:
    """This tensor's shard index along each descriptor, from its own groups (0 where it is not sharded)."""
    out = []
    for d in descriptors:
        sharded = meta.is_tp if d.name == "tp" else meta.is_ep
        ranks = meta.tensor_parallel_group_ranks if d.name == "tp" else meta.expert_parallel_group_ranks
        out.append(_index(ranks, meta.owner_rank) if sharded else 0)
    return tuple(out)


def _check_shapes(name: str, src: ParameterMetadata, dst: ParameterMetadata,
                  descriptors: list[ShardingDescriptor]) -> None:
    sharded = {d.dim: d for d in descriptors}
    problem = None
    if src.dtype != dst.dtype:
        problem = f"dtypes differ (source {src.dtype}, destination {dst.dtype})"
    elif len(src.shape) != len(dst.shape):
        problem = "ranks differ"
    else:
        for dim, (s, t) in enumerate(zip(src.shape, dst.shape)):
            d = sharded.get(dim)
            s_world = len(d.src_dim_ranks) if d else 1
            t_world = len(d.dst_dim_ranks) if d else 1
            if s * s_world != t * t_world:
                problem = (f"dim {dim} holds {s} x {s_world} source shard(s) but {t} x {t_world} destination "
                           f"shard(s)" if d else f"unsharded dim {dim} differs")
                break
    if problem:
        raise ReshardPlanError(f"cannot reshard parameter '{name}': source shape {tuple(src.shape)}, destination "
                               f"shape {tuple(dst.shape)}: {problem}")


def _plan_tensor(name: str, sources: list[ParameterMetadata], dst: ParameterMetadata,
                 dst_rank: int) -> list[tuple[ParameterMetadata, tuple, tuple]]:
    """``(source replica, source slice, destination slice)`` for every piece of one destination tensor."""
    rep = sources[0]
    descriptors = _descriptors(name, rep, dst)
    _check_shapes(name, rep, dst, descriptors)
    by_coords: dict[tuple[int, ...], list[ParameterMetadata]] = {}
    for meta in sources:
        by_coords.setdefault(_coords(meta, descriptors), []).append(meta)
    dst_coords = _coords(dst, descriptors)
    per_dim = []
    for d, dst_idx in zip(descriptors, dst_coords):
        s_world, t_world = len(d.src_dim_ranks), len(d.dst_dim_ranks)
        if d.name == "tp":
            per_dim.append(tp_tiles(name, rep, dst, d.dim, s_world, t_world, dst_idx))
        else:
            per_dim.append(_dim_tiles(name, dst.shape[d.dim] * t_world, s_world, 1, t_world, 1, dst_idx))
    out = []
    for coords, src_slice, dst_slice in combine(len(dst.shape), [d.dim for d in descriptors], per_dim):
        candidates = by_coords.get(coords)
        if not candidates:
            raise ReshardPlanError(f"{name}: no source rank holds shard {coords} of the source layout")
        out.append((select_src_metadata_balanced(candidates, dst, dst_rank), src_slice, dst_slice))
    return out


def _iter_global_transfer_ops(dst_param_metadata_by_rank: dict[int, dict[str, ParameterMetadata]],
                              src_param_metadata: dict[str, list[ParameterMetadata]]) -> Iterator[tuple]:
    """``(task_id, dst_rank, src_rank, src_slice, dst_slice, src_meta, dst_meta)`` for the whole schedule."""
    task_id = 0
    for dst_rank in sorted(dst_param_metadata_by_rank):
        for resolved, dst_meta in dst_param_metadata_by_rank[dst_rank].items():
            sources = src_param_metadata.get(resolved)
            if not sources and resolved.endswith("output_layer.weight"):
                # A tied source has no output layer of its own: its word embedding feeds it.
                sources = next((src_param_metadata[n] for n in _TIED_SOURCES if src_param_metadata.get(n)), None)
            if not sources:
                raise ReshardPlanError(f"destination parameter '{resolved}' on rank {dst_rank} is not in the "
                                       f"source model")
            for src_meta, src_slice, dst_slice in _plan_tensor(resolved, sources, dst_meta, dst_rank):
                yield task_id, dst_rank, src_meta.owner_rank, src_slice, dst_slice, src_meta, dst_meta
                task_id += 1


def _extract_module_metadata(module: torch.nn.Module | None, owner_rank: int, num_experts: int | None,
                             rank_offset: int, rank_list_cache: dict) -> list[ParameterMetadata]:
    if module is None:
        return []
    pg = getattr(module, "pg_collection", None)
    if pg is None:
        raise ValueError(f"{type(module).__name__} has no pg_collection; resharding needs its process groups")
    prefix_map = build_layer_prefix_map(module)
    return [extract_param_metadata(t, name, owner_rank, pg, num_experts=num_experts,
                                   layer_module_prefix_map=prefix_map, rank_offset=rank_offset,
                                   _rank_list_cache=rank_list_cache)
            for name, t in named_refit_tensors(module)]


def index_metadata_rosters(gathered_pairs: list) -> tuple[dict[int, dict[str, ParameterMetadata]],
                                                          dict[str, list[ParameterMetadata]]]:
    """From ``[(src_metas, dst_metas)]`` indexed by rank: destination metadata by rank and by
    ``resolved_name``, and every source replica by ``resolved_name``."""
    dst_by_rank: dict[int, dict[str, ParameterMetadata]] = {}
    src_by_name: dict[str, list[ParameterMetadata]] = {}
    for rank, (src_metas, dst_metas) in enumerate(gathered_pairs):
        dst_by_rank[rank] = {m.resolved_name: m for m in dst_metas}
        for meta in src_metas:
            src_by_name.setdefault(meta.resolved_name, []).append(meta)
    return dst_by_rank, src_by_name


def build_plan_from_rosters(dst_param_metadata_by_rank: dict[int, dict[str, ParameterMetadata]],
                            src_param_metadata: dict[str, list[ParameterMetadata]],
                            my_global_rank: int) -> ReshardPlan:
    """This rank's :class:`ReshardPlan` from already gathered rosters (pure; no communication)."""
    plan = ReshardPlan([], [])
    for task_id, dst_rank, src_rank, src_slice, dst_slice, src_meta, dst_meta in _iter_global_transfer_ops(
            dst_param_metadata_by_rank, src_param_metadata):
        if dst_rank == my_global_rank:
            plan.recv_ops.append(TransferOp(dst_meta.name, src_rank, False, dst_slice, src_slice, task_id))
        if src_rank == my_global_rank:
            plan.send_ops.append(TransferOp(src_meta.name, dst_rank, True, src_slice, dst_slice, task_id))
    logger.debug("rank %d: %s", my_global_rank, plan)
    return plan


def build_local_reshard_plan(src_module: torch.nn.Module | None, dst_module: torch.nn.Module | None,
                             num_experts: int | None = None, group: Any = None, src_rank_offset: int = 0,
                             dst_rank_offset: int = 0) -> ReshardPlan:
    """Gather both models' metadata from every rank of ``group`` (collective) and build this rank's plan.

    Either module may be ``None`` on a rank that only receives, only sends, or (both) only takes part.
    """
    my_rank = group.rank() if group is not None else dist.get_rank()
    world = group.size() if group is not None else dist.get_world_size()
    cache: dict = {}
    mine = (_extract_module_metadata(src_module, my_rank, num_experts, src_rank_offset, cache),
            _extract_module_metadata(dst_module, my_rank, num_experts, dst_rank_offset, cache))
    gathered: list = [None] * world
    dist.all_gather_object(gathered, mine, group=group)
    return build_plan_from_rosters(*index_metadata_rosters(gathered), my_rank)


def build_centralized_reshard_plan(src_module: torch.nn.Module | None, dst_module: torch.nn.Module | None,
                                   num_experts: int | None = None, group: Any = None, src_rank_offset: int = 0,
                                   dst_rank_offset: int = 0) -> ReshardPlan:
    """Deprecated name of :func:`build_local_reshard_plan` (warns, then calls it)."""
    warnings.warn("build_centralized_reshard_plan is deprecated; use build_local_reshard_plan",
                  DeprecationWarning, stacklevel=2)
    return build_local_reshard_plan(src_module, dst_module, num_experts=num_experts, group=group,
                                    src_rank_offset=src_rank_offset, dst_rank_offset=dst_rank_offset)
