"""Fully parallel load (Megatron-Core ``FullyParallelLoadStrategyWrapper``).

Data-parallel replicas hold the same shards, so without help every replica reads every one of
them from storage. This wrapper reads each distinct tensor shard once per parallelization group:
the shards are spread over the ranks that hold them (fewest bytes first), each rank reads its own
share with the wrapped strategy, and the shards are then broadcast over the group. Objects and other
non-tensor entries are read by every rank as usual.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.dict_utils import dict_list_map_outplace, nested_values
from megatron_core.dist_checkpointing.mapping import ShardedStateDict, ShardedTensor
from megatron_core.dist_checkpointing.strategies.base import LoadShardedStrategy
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy

_ShardId = tuple[str, tuple[int, ...], tuple[int, ...]]


def _shard_id(sh: ShardedTensor) -> _ShardId:
    return sh.key, tuple(sh.global_offset), tuple(sh.local_shape)


def _nbytes(sh: ShardedTensor) -> int:
    numel = 1
    for n in sh.local_shape:
        numel *= n
    return numel * torch.empty((), dtype=sh.dtype).element_size()


def distribute_shards(per_rank: list[list[tuple[_ShardId, int]]]) -> dict[_ShardId, int]:
    """Assign each distinct shard to one of the group ranks holding it, balancing bytes (largest first)."""
    holders: dict[_ShardId, list[int]] = {}
    sizes: dict[_ShardId, int] = {}
    for rank, shards in enumerate(per_rank):
        for shard, nbytes in shards:
            holders.setdefault(shard, []).append(rank)
            sizes[shard] = nbytes
    load = [0] * len(per_rank)
    assignment = {}
    for shard in sorted(holders, key=lambda s: (-sizes[s], repr(s))):
        rank = min(holders[shard], key=lambda r: (load[r], r))
        assignment[shard] = rank
        load[rank] += sizes[shard]
    return assignment


class FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy):
    """Wrap a load strategy so each distinct shard is read once in ``parallelization_group`` (default: world).

    ``do_cache_distribution`` reuses the shard assignment of the previous call (only valid when the
    state dict layout does not change). ``exchange_algo`` is accepted for compatibility; shards are
    exchanged by broadcast.
    """

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast") -> None:
        if exchange_algo not in ("broadcast", "gather_object", "gather_rounds"):
            raise ValueError(f"exchange_algo={exchange_algo!r} must be 'broadcast', 'gather_object' or 'gather_rounds'")
        if not isinstance(strategy, LoadShardedStrategy):
            raise CheckpointingException(f"FullyParallelLoadStrategyWrapper wraps a LoadShardedStrategy, got {strategy!r}")
        super().__init__()
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: tuple[dict[_ShardId, int], dict[_ShardId, torch.dtype]] | None = None

    def _group_size(self) -> int:
        return collectives.get_world_size(self.parallelization_group)

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """Load ``sharded_state_dict``, reading each shared tensor shard on one rank of the group only."""
        if self._group_size() == 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        group = self.parallelization_group
        tensors = [x for x in nested_values(sharded_state_dict) if isinstance(x, ShardedTensor)]
        by_id: dict[_ShardId, list[ShardedTensor]] = {}
        for sh in tensors:
            by_id.setdefault(_shard_id(sh), []).append(sh)
        cached = self.cached_distribution if self.do_cache_distribution else None
        if cached is None:
            mine = [(shard, _nbytes(shs[0]), shs[0].dtype) for shard, shs in by_id.items()]
            gathered = collectives.all_gather_object(mine, group)
            distribution = distribute_shards([[(s, n) for s, n, _ in shards] for shards in gathered])
            dtypes = {s: d for shards in gathered for s, _, d in shards}
            cached = (distribution, dtypes)
            if self.do_cache_distribution:
                self.cached_distribution = cached
        distribution, dtypes = cached
        me = collectives.get_rank(group)
        local = {}
        for i, x in enumerate(nested_values(sharded_state_dict)):
            if not isinstance(x, ShardedTensor) or distribution.get(_shard_id(x)) == me:
                local[f"entry_{i}"] = x
        loaded_local = self.base_strategy.load(local, checkpoint_dir)
        results = {id(local[k]): v for k, v in loaded_local.items()}
        comm_device = collectives._flag_device(group)
        for shard in sorted(distribution, key=repr):
            src = distribution[shard]
            holders = by_id.get(shard)
            if src == me:
                buffer = results[id(holders[0])].to(comm_device)
            else:
                buffer = torch.empty(shard[2], dtype=dtypes[shard], device=comm_device)
            dist.broadcast(buffer, src=dist.get_global_rank(group, src) if group is not None else src, group=group)
            for sh in holders or []:
                target = sh.data.device if sh.data is not None else torch.device("cpu")
                results[id(sh)] = buffer.to(target) if src != me else results[id(sh)]

        def pick(x: Any) -> Any:
            if id(x) in results:
                return results[id(x)]
            raise CheckpointingException(f"FullyParallelLoadStrategyWrapper: entry {x!r} was not loaded")

        return dict_list_map_outplace(pick, sharded_state_dict)

    def metadata(self, checkpoint_dir: str | os.PathLike) -> Any:
        """The wrapped strategy's checkpoint metadata."""
        return self.base_strategy.metadata(checkpoint_dir)

    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """The wrapped strategy's tensor metadata."""
        return self.base_strategy.load_tensors_metadata(checkpoint_dir)

    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """The wrapped strategy's sharded metadata."""
        return self.base_strategy.load_sharded_metadata(checkpoint_dir)

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Delegated to the wrapped strategy."""
        self.base_strategy.check_backend_compatibility(loaded_backend)

    def check_version_compatibility(self, loaded_version: int) -> None:
        """Delegated to the wrapped strategy."""
        self.base_strategy.check_version_compatibility(loaded_version)
