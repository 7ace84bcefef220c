"""Deduplicating replicated tensor shards within a group and sending them back (for in-memory checkpoints).

Shards held by several ranks (data-parallel replicas) need to be kept by one of them only. The
owner of every shard is chosen by a deterministic greedy rule over the group's gathered shard
descriptions (Megatron-Core's ``determine_main_replica_uniform_distribution``): shards with fewest
holders first, then largest first, each to the holder with the fewest bytes so far. Since every
rank computes the same assignment, the owner can later broadcast the shard to the ranks needing it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.dict_utils import nested_values
from megatron_core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)

ShardId = tuple


class ShardDistribution(NamedTuple):
    """Who keeps which tensor shard in one group (Megatron-Core's ``ShardDistribution``).

    ``main_rank_for_shard``: shard id -> group rank that keeps it; ``shards_in_this_group``: the
    shard ids distributed; ``shard_to_metadata``: a data-less ``ShardedTensor`` per shard id;
    ``all_ranks_for_shard``: shard id -> group ranks holding (or needing) it.
    """

    main_rank_for_shard: dict[ShardId, int]
    shards_in_this_group: set[ShardId]
    shard_to_metadata: dict[ShardId, ShardedTensor]
    all_ranks_for_shard: dict[ShardId, list[int]]


def tensor_shard_id(sh: ShardedTensor) -> ShardId:
    """Identity of a tensor shard, equal on every rank holding a replica of it."""
    rng = sh.flattened_range
    return sh.key, tuple(sh.global_offset), None if rng is None else (rng.start, rng.stop)


def object_shard_id(sh: ShardedObject) -> ShardId:
    """Identity of an object shard, equal on every rank holding a replica of it."""
    return sh.key, tuple(sh.global_offset), tuple(sh.global_shape)


def _nbytes(sh: ShardedTensor) -> int:
    return math.prod(sh.local_shape) * torch.empty((), dtype=sh.dtype).element_size()


def determine_distribution(sharded_state_dict: ShardedStateDict, group: Any = None,
                           ignore_groups: bool = True) -> ShardDistribution | None:
    """The owner of every tensor shard of the group's state dicts; None for a group of one rank.

    Collective over ``group``. Without ``ignore_groups`` only shards whose main replica lies in the
    group are distributed; with it (used here) every shard the group holds is.
    """
    if collectives.get_world_size(group) <= 1:
        return None
    local = [sh.without_data() for sh in nested_values(sharded_state_dict) if isinstance(sh, ShardedTensor)]
    holders: dict[ShardId, list[int]] = defaultdict(list)
    metadata: dict[ShardId, ShardedTensor] = {}
    with_main, without_main = set(), set()
    for rank, shards in enumerate(collectives.all_gather_object(local, group)):
        for sh in shards:
            sid = tensor_shard_id(sh)
            holders[sid].append(rank)
            metadata.setdefault(sid, sh)
            (with_main if is_main_replica(sh.replica_id) else without_main).add(sid)
    included = with_main | without_main if ignore_groups else with_main
    foreign = included - with_main  # main replica in another group: assigned last
    loads = [0] * collectives.get_world_size(group)
    owners: dict[ShardId, int] = {}
    order = sorted(included, key=lambda s: (s in foreign, len(holders[s]), -_nbytes(metadata[s]), repr(s)))
    for sid in order:
        rank = min(holders[sid], key=lambda r: (loads[r], r))
        owners[sid] = rank
        loads[rank] += _nbytes(metadata[sid])
    return ShardDistribution(owners, included, metadata, {s: holders[s] for s in included})


def _global_rank(group: Any, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


@torch.no_grad()
def exchange_by_broadcast(loaded: dict[ShardId, torch.Tensor], needed: dict[ShardId, ShardedTensor],
                          distribution: ShardDistribution, group: Any = None) -> dict[ShardId, torch.Tensor]:
    """``loaded`` plus every shard of ``needed``, broadcast by its owner; collective over ``group``.

    A received shard goes to the device of the requesting ``ShardedTensor``'s data (CPU if it has none).
    """
    me = collectives.get_rank(group)
    lacking = [s for s, r in distribution.main_rank_for_shard.items()
               if r == me and len(distribution.all_ranks_for_shard[s]) > 1 and s not in loaded]
    if collectives.any_rank_true(bool(lacking), group):
        raise CheckpointingException(
            f"replicated shards cannot be restored: their keeping rank holds no data for them "
            f"(on this rank: {[s[0] for s in lacking[:5]]}); the state dict layout changed since it was saved"
        )
    result = dict(loaded)
    device = collectives._flag_device(group) if collectives.get_world_size(group) > 1 else torch.device("cpu")
    for sid, owner in distribution.main_rank_for_shard.items():
        if len(distribution.all_ranks_for_shard[sid]) == 1:
            continue  # only the owner holds it
        meta = distribution.shard_to_metadata[sid]
        if owner == me:
            buffer = loaded[sid].to(device)
        else:
            buffer = torch.empty(meta.local_shape, dtype=meta.dtype, device=device)
        dist.broadcast(buffer, src=_global_rank(group, owner), group=group)
        if sid in needed and sid not in loaded:
            target = needed[sid].data.device if needed[sid].data is not None else torch.device("cpu")
            result[sid] = buffer.to(target)
    return result
