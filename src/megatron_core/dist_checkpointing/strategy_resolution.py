"""Which sharded strategy a ``save`` or ``load`` of :mod:`.serialization` uses, from its arguments.

Megatron-Core accepts ``None`` (the default strategy), a ``(backend, version)`` tuple or a strategy
object; this library writes and reads ``torch_dist`` only. A load strategy also keeps what it read of
a checkpoint (``metadata.json``, ``.metadata``), so one passed on is not read again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megatron_core.dist_checkpointing.core import CheckpointingException, check_is_distributed_checkpoint
from megatron_core.dist_checkpointing.strategies import (
    LoadShardedStrategy,
    SaveShardedStrategy,
    TorchDistLoadShardedStrategy,
    get_default_save_sharded_strategy,
)
from megatron_core.dist_checkpointing.strategies.torch import get_async_strategy

__all__ = ["check_async_strategy", "checkpoint_strategy", "resolve_save_strategy"]


def resolve_save_strategy(strategy: Any) -> SaveShardedStrategy:
    """The save strategy for ``save``'s ``sharded_strategy`` (``None``, ``(backend, version)`` or a strategy)."""
    if strategy is None:
        return get_default_save_sharded_strategy()
    if isinstance(strategy, tuple):
        return get_default_save_sharded_strategy(*strategy)
    if isinstance(strategy, SaveShardedStrategy):
        return strategy
    raise CheckpointingException(f"sharded_strategy must be a SaveShardedStrategy or (backend, version), got {strategy!r}")


def check_async_strategy(async_strategy: str | None) -> None:
    """Refuse an unknown ``async_strategy``; ``"nvrx"`` needs nvidia-resiliency-ext."""
    if async_strategy not in (None, "mcore", "nvrx"):
        raise TypeError(f"async_strategy {async_strategy} is not supported. Available strategies: nvrx, mcore.")
    if async_strategy == "nvrx":
        get_async_strategy("nvrx")  # ModuleNotFoundError without nvidia-resiliency-ext, as Megatron-Core


def checkpoint_strategy(checkpoint_dir: str | os.PathLike, strategy: Any = None) -> TorchDistLoadShardedStrategy:
    """The load strategy for ``checkpoint_dir``, which must be a complete distributed checkpoint.

    ``strategy`` may be ``None`` or ``(backend, version)`` (a new strategy, checked against
    ``metadata.json``) or a ``LoadShardedStrategy`` (used as it is). The strategy keeps what it read
    of the checkpoint; pass it on to the next call so ``metadata.json`` and ``.metadata`` are read once.
    """
    if not Path(checkpoint_dir).is_dir():
        raise CheckpointingException(f"checkpoint directory {checkpoint_dir} does not exist")
    fresh = strategy is None or isinstance(strategy, tuple)
    if not fresh and not isinstance(strategy, LoadShardedStrategy):
        raise CheckpointingException(f"sharded_strategy must be a LoadShardedStrategy, got {strategy!r}")
    resolved = TorchDistLoadShardedStrategy() if fresh else strategy
    if not isinstance(resolved, TorchDistLoadShardedStrategy):
        raise CheckpointingException(f"{type(resolved).__name__} is not a torch_dist load strategy")
    if not check_is_distributed_checkpoint(checkpoint_dir, resolved.checkpoint_config):
        raise CheckpointingException(
            f"{checkpoint_dir} is not a distributed checkpoint (metadata.json missing or invalid: "
            "another format, or a save that did not complete)"
        )
    if fresh:
        resolved.check_checkpoint_compatibility(checkpoint_dir)
    return resolved
