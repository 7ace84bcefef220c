"""Which rank of a group keeps (saves or reads) each replicated shard, and sending shards to the ranks
that need them (Megatron-Core ``dist_checkpointing.exchange_utils``).

The owner of every tensor shard is chosen by a deterministic greedy rule over the group's gathered
shard descriptions: shards whose main replica lies in another group last, then fewest holders first,
then largest first, then by shard id; each goes to the holder with the fewest bytes so far. Every rank
computes the same assignment, so only metadata travels before the data exchange.

Exchanged tensors travel on the group's device (CUDA for NCCL, CPU for gloo) where Megatron-Core always
uses CUDA. ``gather_rounds`` pads each round's shards to one length, because gloo's ``all_gather``
needs equal sizes.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from itertools import zip_longest
from typing import Any, NamedTuple, TypeVar

import torch
import torch.distributed as dist

from megatron_core._ground.fp8_values import dequantize_fp8_tensor, is_fp8_param
from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.debug_logging import debug_time
from megatron_core.dist_checkpointing.dict_utils import nested_values
from megatron_core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor, is_main_replica
from megatron_core.dist_checkpointing.utils import _sharded_tensor_shard_id, _ShardId

logger = logging.getLogger(__name__)

T = TypeVar("T")

EXCHANGE_ALGOS = ("broadcast", "gather_object", "gather_rounds")
"""The ``exchange_algo`` values :func:`exchange_by_distribution` accepts."""


def is_float8tensor(tensor: Any) -> bool:
    """True for an FP8 parameter (exchanged as its high-precision value)."""
    return is_fp8_param(tensor)


class ShardDistribution(NamedTuple):
    """Who keeps which tensor shard within one (implicit) group.

    ``main_rank_for_shard``: shard id -> group rank that keeps it; ``shards_in_this_group``: the shard
    ids distributed; ``shard_to_metadata``: a data-less ``ShardedTensor`` per shard id;
    ``all_ranks_for_shard``: shard id -> group ranks holding (or needing) it.
    """

    main_rank_for_shard: dict[_ShardId, int]
    shards_in_this_group: set[_ShardId]
    shard_to_metadata: dict[_ShardId, ShardedTensor]
    all_ranks_for_shard: dict[_ShardId, list[int]]


def _shard_size(sh_ten: ShardedTensor) -> int:
    return math.prod(sh_ten.local_shape) * torch.empty((), dtype=sh_ten.dtype).element_size()


def distribute_shards_to_ranks(shard_to_ranks: dict[T, list[int]], shard_to_size: dict[T, int], num_ranks: int,
                               cross_parallelization_group_loads: set[T]) -> dict[T, int]:
    """Shard -> rank doing its work, balancing bytes; the same on every rank given the same inputs.

    Order: shards in ``cross_parallelization_group_loads`` last, fewer holders first, larger first, then
    by shard id; each goes to the holder with the fewest bytes assigned so far (lowest rank on ties).
    """
    loads = [0] * num_ranks
    owners: dict[T, int] = {}
    order = sorted(shard_to_ranks, key=lambda s: (s in cross_parallelization_group_loads,
                                                  len(shard_to_ranks[s]), -shard_to_size[s], s))
    for shard in order:
        rank = min(shard_to_ranks[shard], key=lambda r: (loads[r], r))
        owners[shard] = rank
        loads[rank] += shard_to_size[shard]
    logger.debug("distribute_shards_to_ranks bytes per rank: %s", loads)
    return owners


def determine_main_replica_uniform_distribution(sharded_state_dict: ShardedStateDict, parallelization_group: Any,
                                                ignore_groups: bool = False) -> ShardDistribution | None:
    """The owner of every tensor shard of the group's state dicts; None for a group of one rank.

    Collective over ``parallelization_group`` (None: the world). Without ``ignore_groups`` only shards
    whose main replica lies in the group are distributed (saving); with it every shard the group holds
    is, those whose main replica lies elsewhere assigned last (loading).
    """
    if collectives.get_world_size(parallelization_group) <= 1:
        return None
    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    gathered = collectives.all_gather_object(local, parallelization_group)
    shard_to_ranks: dict[_ShardId, list[int]] = defaultdict(list)
    shard_to_size: dict[_ShardId, int] = {}
    shard_to_metadata: dict[_ShardId, ShardedTensor] = {}
    with_main: set[_ShardId] = set()
    without_main: set[_ShardId] = set()
    for rank, shards in enumerate(gathered):
        for sh in shards:
            sid = _sharded_tensor_shard_id(sh)
            shard_to_ranks[sid].append(rank)
            if sid not in shard_to_metadata:
                shard_to_metadata[sid] = sh
                shard_to_size[sid] = _shard_size(sh)
            (with_main if is_main_replica(sh.replica_id) else without_main).add(sid)
    in_group = with_main | without_main if ignore_groups else set(with_main)
    holders = {s: r for s, r in shard_to_ranks.items() if s in in_group}
    owners = distribute_shards_to_ranks(holders, shard_to_size, len(gathered), in_group - with_main)
    return ShardDistribution(owners, in_group, shard_to_metadata, holders)


def _exchange_buffer(shard_id: _ShardId, needed_shards: dict[_ShardId, ShardedTensor],
                     shard_to_metadata: dict[_ShardId, ShardedTensor],
                     device: torch.device) -> tuple[torch.Tensor, torch.device | None]:
    """An empty buffer on ``device`` to receive ``shard_id`` and where the result goes (None: discarded).

    A needed shard goes to its data's device, or stays on ``device`` when it has no data.
    """
    meta = shard_to_metadata[shard_id]
    buffer = torch.empty(meta.local_shape, dtype=meta.dtype, device=device)
    needed = needed_shards.get(shard_id)
    if needed is None:
        return buffer, None
    return buffer, needed.data.device if needed.data is not None else device


def _sendable(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``, FP8 parameters as their high-precision value."""
    if is_float8tensor(tensor):
        tensor = dequantize_fp8_tensor(tensor)
    return tensor.to(device)


def _single_holder_check(shard_id: _ShardId, distribution: ShardDistribution) -> bool:
    """True when only the owner holds ``shard_id`` (nothing to exchange)."""
    holders = distribution.all_ranks_for_shard[shard_id]
    if len(holders) > 1:
        return False
    if holders[0] != distribution.main_rank_for_shard[shard_id]:
        raise CheckpointingException(
            f"shard {shard_id} is needed by group rank {holders[0]} only but assigned to rank "
            f"{distribution.main_rank_for_shard[shard_id]}"
        )
    return True


@torch.no_grad()
@debug_time("exchange_loaded_tensors_gather_rounds", logger)
def exchange_loaded_tensors_gather_rounds(
    loaded_tensors: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution | None = None, parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """``loaded_tensors`` plus every shard of ``unloaded_shards``, by ``all_gather`` rounds per dtype.

    Round ``i`` of a dtype carries the ``i``-th shard each rank owns (padded to the round's longest).
    Collective over ``parallelization_group``.
    """
    main_rank_for_shard, _, shard_to_metadata, _ = shard_distribution
    me = collectives.get_rank(parallelization_group)
    world = collectives.get_world_size(parallelization_group)
    device = collectives._flag_device(parallelization_group)
    result = dict(loaded_tensors)
    for dtype in sorted({meta.dtype for meta in shard_to_metadata.values()}, key=str):
        by_rank: list[list[_ShardId]] = [[] for _ in range(world)]
        for sid, owner in main_rank_for_shard.items():
            if not _single_holder_check(sid, shard_distribution) and shard_to_metadata[sid].dtype == dtype:
                by_rank[owner].append(sid)
        for round_ids in zip_longest(*by_rank, fillvalue=None):
            sizes = [0 if sid is None else math.prod(shard_to_metadata[sid].local_shape) for sid in round_ids]
            flat = [torch.zeros(max(sizes), dtype=dtype, device=device) for _ in range(world)]
            mine = round_ids[me]
            if mine is not None:
                flat[me][:sizes[me]] = _sendable(result[mine], device).reshape(-1)
            dist.all_gather(flat, flat[me].clone(), group=parallelization_group)
            for rank, sid in enumerate(round_ids):
                if sid is None or rank == me or sid not in unloaded_shards:
                    continue
                _, target = _exchange_buffer(sid, unloaded_shards, shard_to_metadata, device)
                meta = shard_to_metadata[sid]
                result[sid] = flat[rank][:sizes[rank]].reshape(meta.local_shape).to(target)
    return result


def exchange_loaded_tensors_gather_object(
    loaded_tensors: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """Every rank's ``loaded_tensors`` merged, by one ``all_gather_object`` (simple, slow: for debugging).

    Raises ``CheckpointingException`` if two ranks loaded the same shard.
    """
    return _merge_unique(collectives.all_gather_object(loaded_tensors, parallelization_group))


def exchange_loaded_objects_gather_object(loaded_objects: dict[_ShardId, Any]) -> dict[_ShardId, Any]:
    """Every rank's ``loaded_objects`` merged, by one ``all_gather_object`` over the world.

    Raises ``CheckpointingException`` if two ranks loaded the same object shard.
    """
    return _merge_unique(collectives.all_gather_object(loaded_objects))


def _merge_unique(per_rank: list[dict[_ShardId, Any]]) -> dict[_ShardId, Any]:
    merged: dict[_ShardId, Any] = {}
    for part in per_rank:
        merged.update(part)
    if len(merged) != sum(map(len, per_rank)):
        seen: set[_ShardId] = set()
        dup = [k for part in per_rank for k in part if k in seen or seen.add(k)]
        raise CheckpointingException(f"Duplicate shard ids loaded by different ranks: {dup[:5]}")
    return merged


@torch.no_grad()
@debug_time("exchange_loaded_tensors_broadcast", logger)
def exchange_loaded_tensors_broadcast(
    loaded_tensors: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Any = None,
) -> dict[_ShardId, torch.Tensor]:
    """``loaded_tensors`` plus every shard of ``unloaded_shards``, each broadcast by its owner to the group.

    Shards only their owner holds are skipped. Collective over ``parallelization_group``.
    """
    main_rank_for_shard, _, shard_to_metadata, _ = shard_distribution
    me = collectives.get_rank(parallelization_group)
    device = collectives._flag_device(parallelization_group)
    result = dict(loaded_tensors)
    for sid, owner in main_rank_for_shard.items():
        if _single_holder_check(sid, shard_distribution):
            continue
        if owner == me:
            buffer, target = _sendable(result[sid], device), None
        else:
            buffer, target = _exchange_buffer(sid, unloaded_shards, shard_to_metadata, device)
        src = owner if parallelization_group is None else dist.get_global_rank(parallelization_group, owner)
        dist.broadcast(buffer, src=src, group=parallelization_group)
        if target is not None:
            result[sid] = buffer.to(target)
    return result


def exchange_by_distribution(
    loaded_tensors: dict[_ShardId, torch.Tensor], unloaded_shards: dict[_ShardId, ShardedTensor],
    shard_distribution: ShardDistribution, parallelization_group: Any = None, exchange_algo: str = "broadcast",
) -> dict[_ShardId, torch.Tensor]:
    """Exchange loaded shards with ``exchange_algo`` (``broadcast``, ``gather_object``, ``gather_rounds``).

    Collective over ``parallelization_group``. Raises ``CheckpointingException`` on every rank when a rank
    owns a shard that others need but holds no data for it (the state dict changed since it was laid out).
    """
    if shard_distribution is None:
        raise CheckpointingException("exchange_by_distribution needs a shard_distribution (got None)")
    exchange_fn = {
        "broadcast": exchange_loaded_tensors_broadcast,
        "gather_object": exchange_loaded_tensors_gather_object,
        "gather_rounds": exchange_loaded_tensors_gather_rounds,
    }.get(exchange_algo)
    if exchange_fn is None:
        raise NotImplementedError(f"exchange_algo={exchange_algo!r}: supported are {list(EXCHANGE_ALGOS)}")
    me = collectives.get_rank(parallelization_group)
    lacking = [sid for sid, owner in shard_distribution.main_rank_for_shard.items()
               if owner == me and len(shard_distribution.all_ranks_for_shard[sid]) > 1 and sid not in loaded_tensors]
    if collectives.any_rank_true(bool(lacking), parallelization_group):
        raise CheckpointingException(
            f"replicated shards cannot be exchanged: their owning rank holds no data for them "
            f"(on this rank: {[sid[0] for sid in lacking[:5]]}); the state dict layout changed since it was laid out"
        )
    return exchange_fn(loaded_tensors, unloaded_shards, shard_distribution, parallelization_group)
