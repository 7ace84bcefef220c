"""Fully parallel save and load (Megatron-Core ``FullyParallelSaveStrategyWrapper`` /
``FullyParallelLoadStrategyWrapper``).

Replicated shards (the same piece held by several data-parallel ranks) are normally written and read
by the main replica only, which leaves DP rank 0 doing all the work. Both wrappers spread that work:
:func:`~megatron_core.dist_checkpointing.exchange_utils.determine_main_replica_uniform_distribution`
picks one owner per shard (balancing bytes), and
:func:`distribute_main_replicas_with_precomputed_distribution` rewrites ``replica_id`` so the owner
is the main replica (0) and every other holder is not (1). Saving then writes main replicas as usual;
loading reads them on their owners and sends them to the other holders
(:func:`~megatron_core.dist_checkpointing.exchange_utils.exchange_by_distribution`).

Both wrappers change the ``replica_id`` of the ``ShardedTensor``s they are given, as Megatron-Core's do.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from megatron_core.dist_checkpointing import collectives
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.debug_logging import debug_time
from megatron_core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    dict_list_map_outplace,
    nested_values,
)
from megatron_core.dist_checkpointing.exchange_utils import (
    EXCHANGE_ALGOS,
    ShardDistribution,
    determine_main_replica_uniform_distribution,
    exchange_by_distribution,
    exchange_loaded_objects_gather_object,
)
from megatron_core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy, LoadShardedStrategy
from megatron_core.dist_checkpointing.strategies.torch_dist import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)
from megatron_core.dist_checkpointing.utils import _sharded_object_id, _sharded_tensor_shard_id, _ShardId
from megatron_core.dist_checkpointing.validation import validate_sharding_integrity

logger = logging.getLogger(__name__)

T = TypeVar("T", ShardedObject, ShardedTensor)


def distribute_main_replicas_with_precomputed_distribution(
    sharded_state_dict: ShardedStateDict, parallelization_group: Any,
    precomputed_distribution: ShardDistribution | None,
) -> None:
    """Make each shard's owner in ``precomputed_distribution`` its main replica (in place).

    The owner's ``replica_id`` becomes 0, every other ``ShardedTensor``'s 1. A no-op for a group of one
    rank; otherwise ``precomputed_distribution`` (computed over the same group) is required.
    """
    if collectives.get_world_size(parallelization_group) <= 1:
        return
    if precomputed_distribution is None:
        raise ValueError("precomputed_distribution must not be None for a parallelization group of several ranks")
    me = collectives.get_rank(parallelization_group)
    for sh in nested_values(sharded_state_dict):
        if not isinstance(sh, ShardedTensor):
            continue
        sid = _sharded_tensor_shard_id(sh)
        owns = (sid in precomputed_distribution.shards_in_this_group
                and precomputed_distribution.main_rank_for_shard[sid] == me)
        sh.replica_id = 0 if owns else 1


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wrap a ``torch_dist`` save strategy so that writing replicated shards is spread over their holders.

    ``parallelization_group`` (default: world) is the group the writing is balanced within; it should
    cover the replication (usually the data-parallel group). ``do_cache_distribution`` reuses the first
    distribution (valid only while the state dict layout does not change).
    """

    def __init__(self, strategy: TorchDistSaveShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False, backend: str = "torch_dist", version: int = 1) -> None:
        if not isinstance(strategy, TorchDistSaveShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelSaveStrategyWrapper needs a TorchDistSaveShardedStrategy, got {type(strategy).__name__}"
            )
        super().__init__(backend, version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.cached_distribution: ShardDistribution | None = None

    def apply_saving_parallelization(self, sharded_state_dict: ShardedStateDict) -> None:
        """Choose the writing rank of every shard (collective unless cached) and set replica ids."""
        with debug_time("apply_saving_parallelization", logger):
            distribution = self.cached_distribution if self.do_cache_distribution else None
            first = self.cached_distribution is None
            if distribution is None:
                distribution = determine_main_replica_uniform_distribution(sharded_state_dict,
                                                                           self.parallelization_group)
            distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                                   distribution)
            if first:
                leaves = [x for x in nested_values(sharded_state_dict) if isinstance(x, (ShardedTensor, ShardedObject))]
                validate_sharding_integrity(leaves, self.base_strategy.process_group)
            if self.do_cache_distribution:
                self.cached_distribution = distribution

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> AsyncRequest:
        """Spread the writing, then :meth:`TorchDistSaveShardedStrategy.async_save`."""
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.async_save(sharded_state_dict, checkpoint_dir)

    def save_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike,
                     stage: bool) -> AsyncRequest:
        """Spread the writing, then :meth:`TorchDistSaveShardedStrategy.save_request`."""
        self.apply_saving_parallelization(sharded_state_dict)
        return self.base_strategy.save_request(sharded_state_dict, checkpoint_dir, stage)


def _split_by_main_replica(sharded_state_dict: ShardedStateDict, item_type: type[T],
                           shard_id_func: Callable[[T], _ShardId]) -> tuple[dict[_ShardId, T], dict[_ShardId, T]]:
    """``(shards of item_type this rank reads, those other ranks read)``, keyed by shard id."""
    to_load: dict[_ShardId, T] = {}
    unloaded: dict[_ShardId, T] = {}
    for x in nested_values(sharded_state_dict):
        if isinstance(x, item_type):
            (to_load if is_main_replica(x.replica_id) else unloaded)[shard_id_func(x)] = x
    return to_load, unloaded


def _fill_in(sharded_state_dict: ShardedStateDict, loaded: dict[_ShardId, Any], item_type: type[T],
             shard_id_func: Callable[[T], _ShardId]) -> None:
    def fill(x: Any) -> Any:
        if not isinstance(x, item_type):
            return x
        sid = shard_id_func(x)
        if sid not in loaded:
            raise CheckpointingException(f"Missing loaded item shard: {sid}")
        return loaded[sid]

    dict_list_map_inplace(fill, sharded_state_dict)


class FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy):
    """Wrap a load strategy so each distinct tensor shard is read once in ``parallelization_group``.

    Each shard is read by its owner (see the module docstring) and exchanged with ``exchange_algo``
    (``broadcast``, ``gather_object`` or ``gather_rounds``). Object shards are read by their main
    replica and gathered over the world. ``do_cache_distribution`` reuses the first distribution.
    """

    def __init__(self, strategy: LoadShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False, exchange_algo: str = "broadcast") -> None:
        if exchange_algo not in EXCHANGE_ALGOS:
            raise ValueError(f"exchange_algo={exchange_algo!r} must be one of {list(EXCHANGE_ALGOS)}")
        if not isinstance(strategy, LoadShardedStrategy):
            raise CheckpointingException(f"FullyParallelLoadStrategyWrapper wraps a LoadShardedStrategy, got {strategy!r}")
        super().__init__()
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution
        self.exchange_algo = exchange_algo
        self.cached_distribution: ShardDistribution | None = None

    def apply_loading_parallelization(self, sharded_state_dict: ShardedStateDict) -> ShardDistribution | None:
        """Choose the reading rank of every tensor shard (collective unless cached) and set replica ids."""
        distribution = self.cached_distribution if self.do_cache_distribution else None
        if distribution is None:
            distribution = determine_main_replica_uniform_distribution(sharded_state_dict, self.parallelization_group,
                                                                       True)
        distribute_main_replicas_with_precomputed_distribution(sharded_state_dict, self.parallelization_group,
                                                               distribution)
        if self.do_cache_distribution:
            self.cached_distribution = distribution
        return distribution

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """Read this rank's share of ``sharded_state_dict`` and exchange the rest; collective over the group."""
        if collectives.get_world_size(self.parallelization_group) <= 1:
            return self.base_strategy.load(sharded_state_dict, checkpoint_dir)
        with debug_time("FullyParallelLoadStrategyWrapper.load", logger):
            distribution = self.apply_loading_parallelization(sharded_state_dict)
            others = [x for x in nested_values(sharded_state_dict) if not isinstance(x, (ShardedTensor, ShardedObject))]
            if others:
                raise CheckpointingException(
                    f"FullyParallelLoadStrategyWrapper loads ShardedTensors and ShardedObjects only, got {others[:3]}")
            to_load_shards, unloaded_shards = _split_by_main_replica(sharded_state_dict, ShardedTensor,
                                                                     _sharded_tensor_shard_id)
            to_load_objects, unloaded_objects = _split_by_main_replica(sharded_state_dict, ShardedObject,
                                                                       _sharded_object_id)
            loaded_objects = self.base_strategy.load(to_load_objects, checkpoint_dir)
            loaded_tensors = self.base_strategy.load(to_load_shards, checkpoint_dir)
            all_tensors = exchange_by_distribution(loaded_tensors, unloaded_shards, distribution,
                                                   self.parallelization_group, self.exchange_algo)
            missing = unloaded_shards.keys() - all_tensors.keys()
            if missing:
                raise CheckpointingException(f"Missing shards after fully parallel loading: {sorted(missing)[:5]}")
            all_objects = exchange_loaded_objects_gather_object(loaded_objects)
            missing = unloaded_objects.keys() - all_objects.keys()
            if missing:
                raise CheckpointingException(
                    f"Missing object shards after fully parallel loading: {sorted(missing)[:5]}")
            result = dict_list_map_outplace(lambda x: x, sharded_state_dict)
            self.fill_in_deferred_sharded_tensors(result, all_tensors)
            self.fill_in_deferred_sharded_objects(result, all_objects)
            return result

    @staticmethod
    def fill_in_deferred_sharded_tensors(sharded_state_dict: ShardedStateDict,
                                         loaded_tensors: dict[_ShardId, torch.Tensor]) -> None:
        """Replace every ``ShardedTensor`` by its tensor from ``loaded_tensors`` (in place)."""
        _fill_in(sharded_state_dict, loaded_tensors, ShardedTensor, _sharded_tensor_shard_id)

    @staticmethod
    def fill_in_deferred_sharded_objects(sharded_state_dict: ShardedStateDict,
                                         loaded_objects: dict[_ShardId, Any]) -> None:
        """Replace every ``ShardedObject`` by its object from ``loaded_objects`` (in place)."""
        _fill_in(sharded_state_dict, loaded_objects, ShardedObject, _sharded_object_id)

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
