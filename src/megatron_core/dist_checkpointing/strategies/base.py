"""Strategy interfaces: how sharded tensors are written and read (Megatron-Core ``strategies.base``).

``torch_dist`` (PyTorch Distributed Checkpoint files) is the only sharded backend, as in current
Megatron-Core; the common state is stored inside it as in megatron-core 0.19 (see :mod:`..serialization`).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any

from megatron_core.dist_checkpointing.mapping import ShardedStateDict
from megatron_core.dist_checkpointing.strategies.async_utils import AsyncRequest


class SaveShardedStrategy(ABC):
    """Writes the sharded part of a state dict into a checkpoint directory."""

    def __init__(self, backend: str, version: int) -> None:
        self.backend = backend
        self.version = version

    @property
    def can_handle_sharded_objects(self) -> bool:
        """Whether ShardedObjects are written by this strategy (True for ``torch_dist``)."""
        return True

    @abstractmethod
    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> None:
        """Write every shard this rank owns; a collective call."""


class AsyncSaveShardedStrategy(SaveShardedStrategy):
    """A save strategy that can return its work as an :class:`AsyncRequest`."""

    @abstractmethod
    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> AsyncRequest:
        """Plan and stage the save; the returned request writes files and finalizes."""

    def save_request(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike,
                     stage: bool) -> AsyncRequest:
        """The save as a request; ``stage`` makes private copies so tensors may change before it runs."""
        return self.async_save(sharded_state_dict, checkpoint_dir)

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> None:
        """Run the save request now."""
        self.save_request(sharded_state_dict, checkpoint_dir, stage=False).execute_sync()


class LoadShardedStrategy(ABC):
    """Reads the sharded part of a state dict from a checkpoint directory."""

    @abstractmethod
    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
        """The structure of ``sharded_state_dict`` with every shard replaced by its loaded value."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """Data-less ShardedTensors describing every global tensor in the checkpoint."""

    @abstractmethod
    def load_sharded_metadata(self, checkpoint_dir: str | os.PathLike) -> ShardedStateDict:
        """Data-less ShardedTensors and ShardedObjects for everything in the checkpoint."""

    @abstractmethod
    def check_backend_compatibility(self, loaded_backend: str) -> None:
        """Raise unless this strategy reads checkpoints written by ``loaded_backend``."""

    @abstractmethod
    def check_version_compatibility(self, loaded_version: int) -> None:
        """Raise unless this strategy reads ``loaded_version`` of its backend."""
