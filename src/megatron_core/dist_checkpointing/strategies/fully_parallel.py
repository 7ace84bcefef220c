"""Fully parallel save (Megatron-Core ``FullyParallelSaveStrategyWrapper``).

Replicated shards (the same piece held by several data-parallel ranks) are normally written by
the main replica only, which leaves DP rank 0 doing all the writing. Here every replica offers
its shard and DCP's global planner gives each shard to the replica with the fewest bytes
planned so far, so the writing spreads evenly across ranks.
"""

from __future__ import annotations

import os
from typing import Any

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.mapping import ShardedStateDict
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron_core.dist_checkpointing.strategies.base import AsyncSaveShardedStrategy
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistSaveShardedStrategy


class FullyParallelSaveStrategyWrapper(AsyncSaveShardedStrategy):
    """Wrap a ``torch_dist`` save strategy so that writing replicated shards is load-balanced.

    Balancing spans every rank that holds a replica of a shard (a superset of
    ``parallelization_group``, which is accepted for API compatibility).
    """

    def __init__(self, strategy: TorchDistSaveShardedStrategy, parallelization_group: Any = None,
                 do_cache_distribution: bool = False) -> None:
        if not isinstance(strategy, TorchDistSaveShardedStrategy):
            raise CheckpointingException(
                f"FullyParallelSaveStrategyWrapper needs a TorchDistSaveShardedStrategy, got {type(strategy).__name__}"
            )
        super().__init__(strategy.backend, strategy.version)
        self.base_strategy = strategy
        self.parallelization_group = parallelization_group
        self.do_cache_distribution = do_cache_distribution

    def _balanced(self) -> TorchDistSaveShardedStrategy:
        return TorchDistSaveShardedStrategy(
            self.base_strategy.backend, self.base_strategy.version, keep_only_main_replica=False,
            thread_count=self.base_strategy.thread_count, process_group=self.base_strategy.process_group,
        )

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> AsyncRequest:
        """Balanced :meth:`TorchDistSaveShardedStrategy.async_save`."""
        return self._balanced().async_save(sharded_state_dict, checkpoint_dir)

    def save_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike,
                     stage: bool) -> AsyncRequest:
        """Balanced :meth:`TorchDistSaveShardedStrategy.save_request`."""
        return self._balanced().save_request(sharded_state_dict, checkpoint_dir, stage)


from megatron_core.dist_checkpointing.strategies.fully_parallel_load import (  # noqa: E402
    FullyParallelLoadStrategyWrapper as FullyParallelLoadStrategyWrapper,
)
