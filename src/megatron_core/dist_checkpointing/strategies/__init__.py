"""Save and load strategies; ``torch_dist`` is the only sharded backend."""

from __future__ import annotations

import os

from megatron_core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue, AsyncRequest
from megatron_core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SaveShardedStrategy,
)
from megatron_core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron_core.dist_checkpointing.strategies.torch_dist import (
    TorchDistLoadShardedStrategy,
    TorchDistSaveShardedStrategy,
)


def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1) -> SaveShardedStrategy:
    """The save strategy for ``backend`` (only ``torch_dist``)."""
    return TorchDistSaveShardedStrategy(backend, version)


def get_default_load_sharded_strategy(checkpoint_dir: str | os.PathLike | None = None) -> LoadShardedStrategy:
    """The ``torch_dist`` load strategy; with ``checkpoint_dir``, checked against the backend and version
    recorded in its ``metadata.json`` (``CheckpointingException`` when it is not a distributed checkpoint)."""
    strategy = TorchDistLoadShardedStrategy()
    if checkpoint_dir is not None:
        strategy.check_checkpoint_compatibility(checkpoint_dir)
    return strategy


__all__ = [
    "AsyncCallsQueue",
    "AsyncRequest",
    "AsyncSaveShardedStrategy",
    "FullyParallelSaveStrategyWrapper",
    "LoadShardedStrategy",
    "SaveShardedStrategy",
    "TorchDistLoadShardedStrategy",
    "TorchDistSaveShardedStrategy",
    "get_default_load_sharded_strategy",
    "get_default_save_sharded_strategy",
]
